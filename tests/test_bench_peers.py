"""draftsmith bench peers: transformers' decoding and draftsmith's side by side on one target, same outputs."""

import json

from draftsmith.app.cli import main


def test_peers_and_draftsmith_decode_the_same_tokens(tiny_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"Tell me about {w}."}) for w in ("foxes", "dogs", "seas"))
    )
    assert main(["bench", "peers", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                 "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.startswith(("hf_", "ds_"))]
    rows = {c[0]: c for c in table if len(c) == 5 and c[1] != "/"}  # name, tok/s, ratio, same/n, near-ties
    assert set(rows) == {"hf_plain", "hf_assistant", "hf_prompt_lookup", "ds_plain", "ds_draft", "ds_ngram"}
    for name, cols in rows.items():  # greedy: every method reproduces transformers' plain greedy output
        assert cols[3] == "2/2", (name, cols)
