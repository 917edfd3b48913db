"""The pure-Python floor: sequences, the scheduler, the KV block pool with its prefix cache,
sampling parameters and structured-output grammars. Nothing here touches a device or imports
the executor (which imports this floor): the scheduler works on token counts and block ids,
so it is unit-tested with no model."""
