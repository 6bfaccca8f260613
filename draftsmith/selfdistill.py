"""Self-distillation data: the target answers prompts; the answers are kept as token ids.

    draftsmith generate --target smollm2-135m --prompts builtin:train --out data/gen --max-new-tokens 256

Output folder (resumable; `load_generated(dir)` or `datasets.load_dataset("json", data_files=dir + "/shard-*.jsonl")`):

    manifest.json          target, prompt source, sampling params, shard list, counts
    shard-00000.jsonl      rows {"id", "category", "prompt_ids", "response_ids", "finish": "stop"|"length"}

Each shard is written under a tmp name then renamed, and the manifest is rewritten after it, so a killed run
leaves only complete shards; rerunning the same command skips the ids already present and continues.
Response ids end with the eos token when the target stopped (finish="stop"), so a draft learns to stop too.
Token ids (not text) are stored because re-tokenising decoded text does not give back the same ids.

Two engines answer: the target loaded here, decoding with continuous batching (draftsmith.continuous: `batch_size`
sequences in flight), or any OpenAI-compatible server (`server=URL`: llama.cpp's llama-server, vLLM, SGLang;
`server="auto"` starts the pinned llama.cpp for a GGUF target), several requests in flight (draftsmith.serving). The manifest records which (`engine`): one folder is never filled by
both, since their greedy answers part at the quantized kernels' near-ties.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
import zlib
from pathlib import Path

from draftsmith import continuous
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write, check_output_dir, write_json, write_text
from draftsmith.modeling import target_fingerprint, text_config
from draftsmith.models import eos_token_ids
from draftsmith.rundir import lock_dir, lock_holder
from draftsmith.sampling import SamplingParams
from draftsmith.serving import ServerClient

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "draftsmith-generated/1"
FEATURES = "_features"
"""A row's captured hidden states while it waits for its shard (never written into the JSON rows)."""


def _read_manifest(out: Path) -> dict | None:
    f = out / MANIFEST
    if not f.is_file():
        return None
    try:
        man = json.loads(f.read_text())
        if man.get("format") != FORMAT:
            raise ValueError(f"format {man.get('format')!r}")
        return man
    except (ValueError, OSError) as e:
        raise DraftsmithError(
            f"{f} is not a draftsmith generated-data manifest ({e}); use another --out"
        ) from None


def generate_dataset(
    target: str,
    prompts: str | list,
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    sampling: SamplingParams | None = None,
    limit: int | None = None,
    sample: int | None = None,
    skip_long: bool = False,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    shard_size: int = 128,
    model=None,
    tokenizer=None,
    device: str | None = None,
    dtype: str | None = None,
    progress: bool = True,
    for_eval: bool = False,
    server: str | None = None,
    served_model: str | None = None,
    parallel: int = 4,
    capture_layers: list[int] | None = None,
) -> Path:
    """Have `target` answer the prompts in `prompts` (a source for draftsmith.prompts.load_prompts, or a list of
    Prompt) and write a resumable token-id dataset to `out_dir`: settings checked against an existing folder,
    prompts selected (already answered, too long), then answered batch by batch into shards.

    limit: the first N prompts of the source; sample: N prompts drawn at random from all of them (the first N of
    one permutation seeded by `seed`: a larger N later extends the same set, as a larger limit does).
    sampling: decode-time warping (default greedy). `model`/`tokenizer` skip loading `target` (it is still
    recorded). Evaluation sets are refused unless `for_eval` (reference answers for measuring, never training; the
    manifest records the flag and trainers refuse such folders).

    server: answer through an OpenAI-compatible server at this URL instead of loading `target` (its tokenizer and
    config still come from `target`), `parallel` requests at once; "auto" starts llama.cpp's llama-server for a GGUF
    or embedded target. served_model: the server's id of the target's model (default: the one it serves).

    capture_layers: also keep, beside each shard, the target's hidden states over every row's prompt + response
    (the inputs of these hidden_states layers and the final normed state, bf16; `features` in the manifest), taken
    from the forwards that decode: a heads run whose cache needs a subset of them reads them instead of running the
    target over the text again (heads.hidden.fill_from_generated). Local answering only."""
    from draftsmith import models
    from draftsmith.prompts import check_limit, is_eval_source, load_prompts

    sampling = sampling or SamplingParams()
    source = prompts if isinstance(prompts, str) else f"list:{len(prompts)}"
    if isinstance(prompts, str) and is_eval_source(prompts) and not for_eval:
        raise DraftsmithError(
            f"{prompts} is or holds an evaluation set (its prompts match builtin:dev-eval's); generate training "
            "data from other prompts (e.g. builtin:train)"
        )
    if max_new_tokens < 1 or batch_size < 1 or shard_size < 1 or parallel < 1:
        raise DraftsmithError("max_new_tokens, batch_size, shard_size and parallel must be >= 1")
    if server is not None and model is not None:
        raise DraftsmithError("pass a loaded model or a server, not both")
    if capture_layers is not None and server is not None:
        raise DraftsmithError(
            "capture_layers keeps the hidden states of the forwards that decode here; a server's are out of reach: "
            "drop --server or --capture-layers"
        )
    gguf = _auto_server_gguf(target) if server == "auto" else None
    client = ServerClient(server, served_model) if server not in (None, "auto") else None
    check_limit(limit)
    check_limit(sample)
    if limit is not None and sample is not None:
        raise DraftsmithError("pass limit (the first N prompts) or sample (N at random), not both")
    device = models.parse_device(device) if model is None else device
    out = check_output_dir(out_dir)  # before any model loads (a rerun into the same folder resumes)
    holder = lock_holder(out)
    if holder:
        raise DraftsmithError(
            f"{out} is being written by a live generate run ({holder}); wait for it to finish or stop it"
        )
    settings = {
        "target": str(target),
        "prompts": source,
        "limit": limit,
        "sample": sample,
        "for_eval": for_eval,
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": seed,
        "max_prompt_tokens": max_prompt_tokens,
        "engine": "transformers" if server is None else "server",
        "capture_layers": sorted(set(capture_layers)) if capture_layers is not None else None,
    }
    if (
        client is not None
    ):  # a server that is down or serves another model is refused before anything is written
        settings["served_model"] = client.check_model(str(target))
    elif gguf is not None:
        settings["served_model"] = str(target)
    manifest = _check_existing(out, settings)
    plist = load_prompts(prompts, limit=limit) if isinstance(prompts, str) else list(prompts)[:limit]
    if sample is not None:
        order = list(range(len(plist)))
        random.Random(seed).shuffle(order)
        plist = [plist[i] for i in order[:sample]]
    if not plist:
        raise DraftsmithError("the prompt list is empty; pass at least one prompt")
    tokenizer = tokenizer or models.load_tokenizer(target)
    config = model.config if model is not None else models.load_config(target)
    done = {row["id"] for row in _iter_rows(out, manifest)} if manifest else set()
    ctx = getattr(config, "max_position_embeddings", None)
    if capture_layers is not None:
        n = text_config(config).num_hidden_layers
        bad = [i for i in capture_layers if not 0 <= int(i) <= n]
        if bad:
            raise DraftsmithError(
                f"capture layers {bad} are outside {target}'s hidden_states indices [0, {n}]; list layers in range"
            )
    # prompts that do not fit the context are refused before the weights load
    todo = _select_prompts(plist, done, tokenizer, ctx, max_new_tokens, skip_long, max_prompt_tokens)
    if server is None:
        model = model or models.load_model(target, dtype=dtype, device=device, inference=True)
        eos = eos_token_ids(model, tokenizer, required=True)
    else:  # the server holds the weights: config and end-of-sequence ids only
        eos = eos_token_ids(_ConfigOnly(config), tokenizer, required=True)
    if not todo:  # (an empty todo with no earlier rows was refused above)
        log.info("%s: all %d prompts already answered", out, len(plist))
        return out
    todo = sorted(todo, key=lambda t: len(t[2]))  # similar lengths per batch: less left padding
    with contextlib.ExitStack() as stack:
        if gguf is not None:  # started before anything is written: a server failing to load leaves no folder
            from draftsmith.llamacpp import LlamaServer, build_info

            slot_ctx = max((len(ids) for _, _, ids in todo), default=0) + max_new_tokens + 8
            srv = stack.enter_context(
                LlamaServer(gguf, alias=str(target), parallel=parallel, context=slot_ctx)
            )
            client = ServerClient(srv.url, str(target))
            server_info = {"engine": "llama.cpp", "build": build_info(), "gguf": str(gguf)}
        elif client is not None:
            server_info = {"engine": "openai-compatible", "url": client.base}
        manifest = manifest or {
            "format": FORMAT,
            "settings": settings,
            "target_info": models.describe(target) if isinstance(target, str) and target else {},
            "shards": [],
            "n_rows": 0,
        }
        if server is not None:
            manifest["server"] = server_info
        if capture_layers is not None:
            manifest["features"] = {
                "layers": settings["capture_layers"],
                "hidden_size": int(text_config(config).hidden_size),
                "dtype": "bfloat16",
                "target_fingerprint": target_fingerprint(model),
            }
        stack.enter_context(lock_dir(out, "--out"))  # one writer per folder: two would write the same shards
        write_json(out / MANIFEST, manifest)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc="generate", unit="prompt", disable=not progress)
        t0 = time.perf_counter()
        if client is None:
            rows = _answer_local(model, todo, eos, max_new_tokens, sampling, seed, batch_size, bar,
                                 settings["capture_layers"])  # fmt: skip
        else:
            rows = _answer_server(client, settings["served_model"], todo, eos, max_new_tokens, sampling, seed,
                                  parallel, bar)  # fmt: skip
        n_tokens = _write_rows(out, manifest, rows, shard_size)
    bar.close()
    rate = n_tokens / (time.perf_counter() - t0)
    log.info("generated %d responses, %d tokens (%.0f tok/s) into %s", len(todo), n_tokens, rate, out)
    return out


class _ConfigOnly:
    """Stands in for a model where only its config is loaded: eos_token_ids reads generation_config."""

    def __init__(self, config):
        from transformers import GenerationConfig

        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)


def _auto_server_gguf(target: str) -> Path:
    """The GGUF file llama-server loads for `target` with server="auto"; refused (before any work) when `target` is
    not a GGUF or embedded model, or when llama.cpp is not built."""
    from draftsmith import llamacpp, models

    ref = models.resolve(target)
    if ref.kind != "gguf":
        raise DraftsmithError(
            f"--server auto starts llama.cpp, which loads GGUF files; {target} is not one: pass a .gguf or "
            "embedded target, or start a server for it and pass --server URL"
        )
    llamacpp.binary("llama-server")
    return Path(ref.path) / ref.gguf_file


def _check_existing(out: Path, settings: dict) -> dict | None:
    """The manifest of an earlier run in `out` (None if new); refused when made with other settings. `limit` and
    `sample` may grow between runs: a larger one extends the dataset with the prompts not yet answered. Capture
    may start in a folder that has none (its earlier rows simply have no states), never change its layers."""
    manifest = _read_manifest(out)
    held = ((manifest or {}).get("features") or {}).get("layers")
    want = settings.get("capture_layers")
    if held is not None and want is not None and held != want:
        raise DraftsmithError(
            f"{out} holds hidden states of layers {held}; pass --capture-layers {','.join(map(str, held))} "
            "or use another --out"
        )
    earlier = {
        "engine": "transformers",
        **(manifest or {}).get("settings", {}),
    }  # folders from before engines
    differs = [
        k
        for k in settings
        if k not in ("limit", "sample", "capture_layers")
        and manifest is not None
        and earlier.get(k) != settings[k]
    ]
    if differs:  # (a key missing from an older manifest reads as None, the default)
        diff = differs[0]
        raise DraftsmithError(
            f"{out} holds data generated with other settings ({diff}: {earlier.get(diff)!r} vs "
            f"{settings[diff]!r}); use another --out"
        )
    return manifest


def _select_prompts(plist, done, tokenizer, ctx, max_new_tokens, skip_long, max_prompt_tokens) -> list[tuple]:
    """(key, prompt, prompt ids) still to answer: not answered before, fitting the context (or skipped with
    skip_long) and max_prompt_tokens. Refuses a run where every prompt would be skipped."""
    from draftsmith.prompts import prompt_ids

    keys = [p.id for p in plist]
    if len(set(keys)) != len(keys):  # ids must be unique to resume; fall back to positions
        keys = [str(i) for i in range(len(plist))]
    todo = []
    for key, p in zip(keys, plist):
        if key in done:
            continue
        try:
            ids = prompt_ids(tokenizer, p, max_length=(ctx - max_new_tokens) if ctx else None)
        except DraftsmithError:
            if skip_long:
                continue
            raise
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            continue
        todo.append((key, p, ids))
    if not todo and not done:  # nothing answered before, nothing to answer now: an empty dataset helps no one
        limits = [f"--max-prompt-tokens {max_prompt_tokens}"] if max_prompt_tokens is not None else []
        limits += [f"the context ({ctx} positions, {max_new_tokens} kept for the answer)"] if ctx else []
        raise DraftsmithError(
            f"all {len(plist)} prompts were skipped as longer than {' or '.join(limits)}; nothing to "
            "generate - lower --max-new-tokens, raise --max-prompt-tokens or pass shorter prompts"
        )
    return todo


def _answer_local(model, todo, eos, max_new_tokens, sampling, seed, batch_size, bar, capture=None):
    """Rows for `todo`, answered by the loaded model with continuous batching (draftsmith.continuous: `batch_size`
    sequences in flight, a finished one replaced by the next prompt at once); one row per list, as each ends. With
    `capture`, a row holds its hidden states under FEATURES until its shard is written."""
    t0, n_tokens = time.perf_counter(), 0
    by_key = {key: (p, ids) for key, p, ids in todo}
    prompts = [(key, ids) for key, _, ids in todo]
    answers = continuous.answer(
        model, prompts, eos, max_new_tokens=max_new_tokens, slots=batch_size, sampling=sampling, seed=seed,
        capture=capture,
    )  # fmt: skip
    for a in answers:
        p, ids = by_key[a.key]
        n_tokens += len(a.tokens)
        bar.update(1)
        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        row = _row(a.key, p, ids, a.tokens, a.finish)
        if a.features is not None:
            row[FEATURES] = a.features
        yield [row]


def _answer_server(client, served_model, todo, eos, max_new_tokens, sampling, seed, parallel, bar):
    """Rows for `todo`, answered by the server with `parallel` requests in flight; yielded in `todo` order (so
    shards do not depend on which request finished first). A failed request stops the run after the rows before it
    are yielded; the requests still queued are cancelled."""
    from concurrent.futures import ThreadPoolExecutor

    t0, n_tokens = time.perf_counter(), 0

    def ask(item):
        key, _, ids = item
        # a per-prompt seed: sampled answers do not depend on the order requests finish in
        return client.complete(ids, max_new_tokens, sampling, _prompt_seed(seed, key), served_model)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(ask, item) for item in todo]
        try:
            for (key, p, ids), fut in zip(todo, futures):
                done = fut.result()
                resp, finish = _cut_at_eos(done.ids, eos)
                if done.finish == "stop" and finish != "stop":  # the server drops the end-of-sequence token
                    resp, finish = resp + [eos[0]], "stop"
                n_tokens += len(resp)
                bar.update(1)
                bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}", refresh=False)
                yield [_row(key, p, ids, resp, finish)]
        finally:
            for fut in futures:
                fut.cancel()


def _prompt_seed(seed: int, key: str) -> int:
    return zlib.crc32(f"{seed}:{key}".encode()) & 0x7FFFFFFF


def _row(key, prompt, prompt_ids, resp, finish) -> dict:
    return {
        "id": key,
        "category": prompt.category,
        "prompt_ids": prompt_ids,
        "response_ids": resp,
        "finish": finish,
    }


def _write_rows(out: Path, manifest: dict, batches, shard_size: int) -> int:
    """Write the rows `batches` yields into shards of `shard_size` rows; returns the answer tokens written. If
    answering fails (a server error, Ctrl-C), the rows answered so far are still written as a shard before the error
    goes on: a rerun of the same command resumes after them."""
    buffer: list[dict] = []
    n_tokens = 0
    try:
        for rows in batches:
            buffer += rows
            n_tokens += sum(len(r["response_ids"]) for r in rows)
            if len(buffer) >= shard_size:
                _flush(out, manifest, buffer)
                buffer = []
    finally:
        if buffer:
            _flush(out, manifest, buffer)
    return n_tokens


def _cut_at_eos(resp: list[int], eos: list[int]) -> tuple[list[int], str]:
    for j, tok in enumerate(resp):
        if tok in eos:
            return resp[: j + 1], "stop"
    return resp, "length"


def _flush(out: Path, manifest: dict, rows: list[dict]) -> None:
    """Write `rows` as the next shard (its captured states first, as a safetensors file beside it), then list it
    in the manifest: a shard the manifest names is complete."""
    from safetensors.torch import save_file

    name = f"shard-{len(manifest['shards']):05d}.jsonl"
    entry = {"file": name, "n_rows": len(rows)}
    feats = {f"{r['id']}.{k}": t.contiguous() for r in rows for k, t in r.pop(FEATURES, {}).items()}
    if feats:
        entry["features"] = name.replace(".jsonl", ".features.safetensors")
        atomic_write(out / entry["features"], lambda tmp: save_file(feats, str(tmp)))
    write_text(out / name, "".join(json.dumps(row) + "\n" for row in rows))
    manifest["shards"].append(entry)
    manifest["n_rows"] += len(rows)
    write_json(out / MANIFEST, manifest)


def _iter_rows(out: Path, manifest: dict):
    for shard in manifest["shards"]:
        f = out / shard["file"]
        if not f.is_file():
            raise DraftsmithError(
                f"{f} is listed in {out / MANIFEST} but missing; regenerate into a new folder"
            )
        with f.open() as fh:
            for n, line in enumerate(fh):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    raise DraftsmithError(
                        f"{f} line {n + 1} is not valid JSON; the shard is corrupt, delete the folder"
                    ) from None


def load_generated(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows of a `draftsmith generate` folder: dicts with id, category, prompt_ids, response_ids, finish."""
    out = Path(path)
    if not out.is_dir():
        raise DraftsmithError(f"generated data folder {out} not found; create it with draftsmith generate")
    manifest = _read_manifest(out)
    if manifest is None:
        raise DraftsmithError(f"{out} has no {MANIFEST}; it is not a draftsmith generate output folder")
    rows = []
    for row in _iter_rows(out, manifest):
        if not isinstance(row.get("prompt_ids"), list) or not isinstance(row.get("response_ids"), list):
            raise DraftsmithError(f"{out}: row {row.get('id')!r} lacks prompt_ids/response_ids lists")
        rows.append(row)
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise DraftsmithError(f"{out} holds no generated rows yet; run draftsmith generate into it")
    return rows


def generated_features(path: str | Path) -> tuple[dict, dict[str, Path]] | None:
    """The hidden states `capture_layers` stored in a generate folder: (the manifest's `features` record -- layers,
    hidden_size, dtype, target_fingerprint --, {row id: its features file}); None for a folder without them. A
    file's tensors are "{id}.last" [T, H] and "{id}.aux" [T, len(layers) * H] over prompt + response."""
    out = Path(path)
    manifest = _read_manifest(out) if out.is_dir() else None
    if manifest is None or "features" not in manifest:
        return None
    files: dict[str, Path] = {}
    for shard in manifest["shards"]:
        if "features" in shard:
            with (out / shard["file"]).open() as fh:
                for line in fh:
                    files[str(json.loads(line)["id"])] = out / shard["features"]
    return manifest["features"], files


def data_files(path: str | Path) -> list[str]:
    """Shard paths for `datasets.load_dataset("json", data_files=data_files(dir))`."""
    out = Path(path)
    manifest = _read_manifest(out)
    if manifest is None:
        raise DraftsmithError(f"{out} has no {MANIFEST}; it is not a draftsmith generate output folder")
    return [str(out / s["file"]) for s in manifest["shards"]]
