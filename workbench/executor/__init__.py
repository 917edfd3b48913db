"""What runs a scheduled step on a device: the model runner (inputs, KV pool, attention
metadata), the staging of every host-to-device copy, graph capture and replay, the sampling
metadata and the sampler, the models and their weights. Device specifics come from
`workbench.platforms`."""
