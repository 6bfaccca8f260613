"""Build draftsmith/data/train/reference_responses.jsonl.gz from ../shared/data/train (run once; output is shipped).

Prompt + human-written response pairs (GSM8K worked answers without their <<calculator>> notes, GPTeacher code and
roleplay responses; self-instruct seed outputs are read too, but all 175 seed tasks are already builtin:train
prompts, so none is kept). Trainers use them as *fixed* text the target scores (DistillSpec's fixed-data policy; EAGLE's
ShareGPT-style data): the labels are the target's own distributions, so the text only has to be varied. Prompts
already in quickstart_prompts.jsonl are left out, so `builtin:train` and `builtin:train-text` do not overlap.

    python scripts/build_train_text.py [--shared ../shared/data/train] [--per-source 2500]
"""

import argparse
import gzip
import json
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "draftsmith" / "data" / "train"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "train")
    )
    ap.add_argument("--per-source", type=int, default=2500)
    args = ap.parse_args()
    src = Path(args.shared)
    used = set()
    with (OUT / "quickstart_prompts.jsonl").open() as f:
        for line in f:
            used.add(json.loads(line)["prompt"].strip())

    def prompt_of(instruction: str, inp: str = "") -> str:
        return f"{instruction}\n\n{inp}".strip() if inp.strip() else instruction.strip()

    pools: dict[str, list[dict]] = {"math": [], "code": [], "roleplay": [], "instruct": []}
    with (src / "gsm8k" / "train.jsonl").open() as f:
        for line in f:
            r = json.loads(line)
            answer = re.sub(r"<<[^>]*>>", "", r["answer"]).strip()  # drop GSM8K's calculator annotations
            pools["math"].append({"prompt": r["question"].strip(), "response": answer})
    for name, cat in (
        ("codegen-instruct.json", "code"),
        ("roleplay-simple-deduped-roleplay-instruct.json", "roleplay"),
    ):
        for r in json.loads((src / "gpteacher" / name).read_text()):
            if r.get("response", "").strip():
                pools[cat].append(
                    {
                        "prompt": prompt_of(r["instruction"], r.get("input", "")),
                        "response": r["response"].strip(),
                    }
                )
    with (src / "self_instruct" / "seed_tasks.jsonl").open() as f:
        for line in f:
            r = json.loads(line)
            for inst in r["instances"]:
                if inst.get("output", "").strip():
                    pools["instruct"].append(
                        {
                            "prompt": prompt_of(r["instruction"], inst.get("input", "")),
                            "response": inst["output"].strip(),
                        }
                    )
    rows = []
    rng = random.Random(0)
    for cat, pool in pools.items():
        pool = [r for r in pool if r["prompt"] not in used]
        rng.shuffle(pool)
        rows += [{**r, "category": cat} for r in pool[: args.per_source]]
    rng.shuffle(rows)
    with gzip.open(OUT / "reference_responses.jsonl.gz", "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    counts = {c: sum(r["category"] == c for r in rows) for c in pools}
    print(f"wrote {len(rows)} rows {counts} to {OUT / 'reference_responses.jsonl.gz'}")


if __name__ == "__main__":
    main()
