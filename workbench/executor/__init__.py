"""What runs a scheduled step on a device: the model runner (inputs, KV pool, attention
metadata), graph capture and replay, the sampler, the models and their weights. Device
specifics come from `workbench.platforms`."""
