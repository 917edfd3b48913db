"""lm-eval on an engine in this process, on a small local task: how the weight formats'
accuracy is reported (bench.formats), with lm-eval's own harness doing the scoring.

`EngineLM` is an lm-eval model over `Engine`: a request's loglikelihood is the sum of the
prompt logprobs of its continuation's tokens (one prefill of context + continuation, every
request of a call submitted at once so they batch), greedy when each of those tokens is the
argmax. `TASK` is 40 general-knowledge multiple-choice questions written for this purpose
(lm-eval's hub datasets cannot be fetched here), run as a local JSON task."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..core.sampling_params import SamplingParams

TASK = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of zero degrees", ["Fahrenheit", "Celsius", "Kelvin", "Rankine"], 1),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("Two plus two equals", ["three", "five", "four", "six"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud", "heavy"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("The chemical symbol for water is", ["CO2", "H2O", "NaCl", "O2"], 1),
    ("The first month of the year is", ["March", "December", "January", "June"], 2),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The color of a clear daytime sky is", ["green", "red", "blue", "purple"], 2),
    ("A week has", ["five days", "seven days", "ten days", "twelve days"], 1),
    ("The capital of Japan is", ["Beijing", "Seoul", "Bangkok", "Tokyo"], 3),
    ("The tallest animal on land is the", ["giraffe", "elephant", "horse", "lion"], 0),
    ("Ice is the solid form of", ["air", "water", "sand", "salt"], 1),
    ("The planet we live on is called", ["Earth", "Mars", "Saturn", "Neptune"], 0),
    ("A triangle has", ["two sides", "three sides", "four sides", "five sides"], 1),
    ("Humans breathe in", ["oxygen", "helium", "neon", "argon"], 0),
    ("The capital of Italy is", ["Milan", "Naples", "Rome", "Venice"], 2),
    ("Ten minus three equals", ["six", "seven", "eight", "nine"], 1),
    ("The largest ocean on Earth is the", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("Plants make their food through", ["digestion", "photosynthesis", "respiration", "fermentation"], 1),
    ("The freezing point of water in Fahrenheit is", ["0 degrees", "32 degrees", "100 degrees", "212 degrees"], 1),
    ("A spider has", ["six legs", "eight legs", "ten legs", "four legs"], 1),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "William Shakespeare", "Jane Austen", "Mark Twain"], 1),
    ("The capital of Germany is", ["Munich", "Hamburg", "Berlin", "Frankfurt"], 2),
    ("The fastest land animal is the", ["cheetah", "turtle", "cow", "sheep"], 0),
    ("The moon orbits the", ["Sun", "Earth", "Mars", "Venus"], 1),
    ("Five times five equals", ["ten", "twenty", "twenty-five", "fifty"], 2),
    ("The boiling point of water at sea level in Celsius is", ["50 degrees", "100 degrees", "150 degrees", "200 degrees"], 1),
    ("The primary language spoken in Brazil is", ["Spanish", "Portuguese", "French", "English"], 1),
    ("The currency of the United States is the", ["euro", "yen", "dollar", "pound"], 2),
    ("The capital of Spain is", ["Barcelona", "Madrid", "Seville", "Valencia"], 1),
    ("An animal that eats only plants is a", ["carnivore", "herbivore", "predator", "scavenger"], 1),
    ("The hardest natural material is", ["gold", "diamond", "iron", "glass"], 1),
    ("The number of continents on Earth is", ["five", "six", "seven", "nine"], 2),
    ("Sound travels fastest through", ["vacuum", "air", "steel", "cotton"], 2),
    ("The capital of Canada is", ["Toronto", "Vancouver", "Ottawa", "Montreal"], 2),
    ("The gas that plants take in from the air is", ["oxygen", "carbon dioxide", "nitrogen", "hydrogen"], 1),
    ("The longest river in Africa is the", ["Nile", "Amazon", "Danube", "Thames"], 0),
]


def engine_lm(engine):
    """An lm-eval LM over `engine` (lm_eval imported here: it is an optional dependency)."""
    from lm_eval.api.model import LM

    class EngineLM(LM):
        def __init__(self):
            super().__init__()
            self.engine, self.tok = engine, engine.tokenizer

        def loglikelihood(self, requests):
            pairs = []
            for r in requests:
                context, continuation = r.args
                ctx = self.tok.encode(context, add_special_tokens=False)
                whole = self.tok.encode(context + continuation, add_special_tokens=False)
                pairs.append((whole, len(ctx)))
            outs = self.engine.generate([w for w, _ in pairs],
                                        SamplingParams(max_tokens=1, temperature=0,
                                                       prompt_logprobs=1))
            res = []
            for (whole, n), o in zip(pairs, outs):
                rows = [(o.prompt_logprobs[p][whole[p]]) for p in range(n, len(whole))]
                res.append((sum(x.logprob for x in rows), all(x.rank == 1 for x in rows)))
            return res

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError("the local task is multiple choice")

        def generate_until(self, requests):
            raise NotImplementedError("the local task is multiple choice")

    return EngineLM()


def accuracy(engine) -> dict:
    """lm-eval's acc and acc_norm on TASK for `engine` (needs the lm-eval package)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a})
                                            + "\n" for q, c, a in TASK))
        (d / "wb_local_mc.yaml").write_text(
            "task: wb_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {d / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
            "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{answer}}'\ntarget_delimiter: ' '\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
        out = lm_eval.simple_evaluate(model=engine_lm(engine), tasks=["wb_local_mc"],
                                      task_manager=TaskManager(include_path=str(d)))
    r = out["results"]["wb_local_mc"]
    return dict(acc=round(r["acc,none"], 3), acc_norm=round(r["acc_norm,none"], 3),
                n=len(TASK))
