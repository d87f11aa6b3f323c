"""One SFT job's loop on the built-in model, for A/B runs of two revisions (issue 46's TrainLoop):

    for tree in OLD NEW OLD NEW; do (cd $tree && PYTHONPATH=src OMP_NUM_THREADS=1 python bench/sft_loop.py); done

run_sft for 3 epochs of 8 examples, batch 2 (12 steps), LoRA r=8 on q/k/v/o, packing on; prints seconds per
step (under exclusive ownership), wall seconds and the final loss (equal losses: the same arithmetic).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from peft import get_peft_model  # noqa: E402

from kiln.runtime.loader import load_model  # noqa: E402
from kiln.training.core.data import tokenize_sft  # noqa: E402
from kiln.training.core.loop import Hooks, Plan  # noqa: E402
from kiln.training.core.lora import add_private_adapter, lora_config  # noqa: E402
from kiln.training.schemas import SFTExample  # noqa: E402
from kiln.training.sft.job import run_sft  # noqa: E402
from tests.conftest import built_model_path  # noqa: E402


def main() -> None:
    lm = load_model(built_model_path(), device="cpu")
    pm = get_peft_model(lm.model, lora_config(2, 4, ["q_proj"]), adapter_name="idle")
    examples = [SFTExample.model_validate({"messages": [
        {"role": "user", "content": f"What is the colour of thing {i}?"},
        {"role": "assistant", "content": f"Thing {i} is colour {i * 7}."}]}) for i in range(8)]
    rows = tokenize_sft(lm.tokenizer, examples, max_seq_len=256)
    add_private_adapter(pm, "ab", lora_config(8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]), seed=0)
    t0 = time.perf_counter()
    rep = run_sft(pm, "ab", rows, Plan(1e-3, 3, 2, 0, packing=True), pad_id=lm.tokenizer.pad_token_id, hooks=Hooks())
    print(json.dumps({"steps": rep.steps, "step_s": rep.train_seconds / rep.steps,
                      "wall_s": time.perf_counter() - t0, "final_loss": rep.final_loss,
                      "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
