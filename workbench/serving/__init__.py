"""HTTP on both sides of the OpenAI protocol: `workbench serve` (protocol, app, metrics) and
a client for any compatible server (`client.RemoteEngine`). FastAPI, uvicorn and httpx are
imported only here, so `import workbench` stays light."""
