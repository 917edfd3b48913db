"""A modelled device (`device="model:<name>"`): the real scheduler, block pool, prefix cache,
preemption and telemetry, with each step's time taken from a cost model instead of a forward
pass (Vidur's idea, MLSys 2024, at the granularity of a step).

    profiles.py  the devices: their roofs (peak FLOP/s, HBM bandwidth), memory, graph rules,
                 and the cost coefficients fitted to measurements (or spec-sheet guesses,
                 marked uncalibrated)
    cost.py      one step's time: its FLOPs and bytes (roofline.step_cost) against the roofs,
                 plus launch and host costs, eager or graphed
    fit.py       fitting the coefficients: to a real engine's step records (the CPU), or to
                 recorded aggregate figures through the step sequences they imply (the H200)
    runner.py    the model runner that replaces the forward pass: it times the step and picks
                 random tokens
    speculative.py  speculative decoding there: drafts accepted at a rate a real run measured
                 on the workload (acceptance_of: from a real engine or a trace)
    accuracy.json  the measured error of each calibrated profile (benchmarks/modelled_accuracy.py)
"""
from .cost import StepTime, step_time
from .profiles import DeviceProfile, get_profile, profile_names
from .runner import ModelledRunner
from .speculative import acceptance_of

__all__ = ["DeviceProfile", "ModelledRunner", "StepTime", "acceptance_of", "get_profile",
           "profile_names", "step_time"]
