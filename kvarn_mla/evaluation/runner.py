"""`kvarn-mla eval`: run a suite for several cache methods, resumably, and summarize.

Every finished unit of work (one generated item, one accumulation curve, ...) is appended to ``OUT.jsonl`` as it
completes; a rerun with the same ``--out`` skips what is there. The summary goes to ``OUT`` (JSON).

A record names everything that changes its result, so a resume never reuses another configuration's work:

- ``run``: the run configuration shared by all records of ``OUT.jsonl`` (`run_config`): the record format, the
  suite (by its own name), the model (a digest of its config and weights, its dtype and device type) and the suite's
  settings (digests of the text and the greedy prompt, chunk and token counts; sampling, batch size, the seed when it
  matters, the retrieval context, the task file's digest);
- ``method`` and ``method_spec``: the method's name and a digest of its definition (a preset's fields);
- ``key`` (and for generated items ``item``, a digest of the prompt, budget and checks).

A rerun whose configuration differs from the records there refuses, naming what differs (write to another
``--out``). Records written before this (no ``run``) are *legacy*: they still summarize (``compute=False``) but
are never resumed into, as nothing says what produced them.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkers import wilson_interval
from .methods import Method, reference_label, with_reference_label

SUITES = ("accumulation", "reasoning", "retrieval", "worst-vectors", "jsonl")
GREEDY_PROMPT = 512  # tokens of the text that prompt the free-running greedy comparison
RECORD_FORMAT = 2  # records with a ``run`` field; legacy records (format 1) have none
LEGACY_REFERENCE_DTYPE = "bfloat16"  # legacy records label the unquantized reference "bf16", whatever its dtype
_META = ("suite", "method", "key", "run", "method_spec", "item")  # record fields that are not results
_NOT_CHECKS = (*_META, "id", "new_tokens", "text", "first_miss", "target_tokens")  # generation record fields
_VOLATILE_CONFIG = ("transformers_version", "name_or_path")  # model config fields that do not change a result


def _digest(data: bytes | str) -> str:
    """16 hex digits of SHA-256 (64 bits: distinct runs never collide in practice)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def file_digest(path: str | Path) -> str:
    """Digest of a file's bytes (a task file: its prompts, answers and checkers)."""
    return _digest(Path(path).read_bytes())


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a tensor's dtype, shape and values (token ids of a text or a prompt)."""
    data = tensor.detach().cpu().contiguous().reshape(-1)
    hasher = hashlib.sha256(f"{data.dtype}:{tuple(tensor.shape)}".encode())
    hasher.update(data.view(torch.uint8).numpy())
    return hasher.hexdigest()[:16]


def model_identity(model, name: str | None = None) -> dict:
    """What identifies a model's results: ``digest`` of its config and every tensor of its state dict (weights and
    persistent buffers, in the dtype it runs in), ``dtype``, ``device`` type, and ``name`` (for messages only).

    Hashes every weight once (a few seconds per GB); the bundled reference models take milliseconds.
    """
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG}
    hasher = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for key, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous().reshape(-1)
        hasher.update(f"{key}:{data.dtype}:{tuple(tensor.shape)}".encode())
        hasher.update(data.view(torch.uint8).numpy())
    parameter = next(model.parameters())
    return {"name": name or getattr(model.config, "name_or_path", "") or type(model).__name__,
            "digest": hasher.hexdigest()[:16], "dtype": str(parameter.dtype).removeprefix("torch."),
            "device": parameter.device.type}


def method_spec(method: Method) -> str:
    """Digest of a method's definition: a preset renamed or redefined between runs does not reuse results."""
    definition = (method.kind, method.config, method.backend, method.nbits, sorted(method.cache_kwargs.items()))
    return _digest(repr(definition))


def item_digest(item) -> str:
    """Digest of a generation item's prompt, token budget and check names (an id reused for another item)."""
    return _digest(json.dumps([item.prompt, item.max_new_tokens, sorted(item.checks)]))


def run_config(suite: str, identity: dict, settings: dict) -> dict:
    """The ``run`` field of every record of a run, in its JSON form (as read back from the records)."""
    return json.loads(json.dumps({"format": RECORD_FORMAT, "suite": suite, "model": identity, "settings": settings}))


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(recorded: dict, current: dict) -> list[str]:
    """What differs between two run configurations, one ``"field: recorded -> current"`` string per field (the
    model's name is not compared: the same weights under another path are the same model)."""
    old, new = _flatten(recorded), _flatten(current)
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if key != "model.name" and old.get(key) != new.get(key)]


def read_records(path: Path) -> list[dict]:
    """The whole records of a ``.jsonl`` file (none if it does not exist). A line cut short by an interruption is
    skipped (its unit is redone), and a file that ends mid-line is given a newline, so the next record appended
    starts on a line of its own."""
    if not path.exists():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        with path.open("a") as f:
            f.write("\n")
    records = []
    for line in text.splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class ResultLog:
    """Append-only JSONL of the finished records of one run configuration, keyed by ``(method, key)``.

    Args:
        path: The ``.jsonl`` file (created on the first record).
        config: This run's `run_config`.
        compute: Whether this run will add records. Without it, a file of legacy records only is read as legacy
            (``legacy`` is True; records are those of the suite's legacy label), to summarize a finished old run.

    Raises:
        ValueError: the file holds records of another configuration (the message names what differs), or legacy
            records when this run computes or the file also holds new records.
    """

    def __init__(self, path: Path, config: dict, compute: bool = True):
        self.path, self.config, self.legacy = path, config, False
        self.records: dict[tuple[str, str], dict] = {}
        current, legacy = [], []
        for record in read_records(path):
            if "run" not in record:
                legacy.append(record)
            elif config_differences(record["run"], config):
                raise ValueError(self._foreign(record["run"]))
            else:
                current.append(record)
        if legacy and (compute or current):
            raise ValueError(
                f"{path} holds {len(legacy)} legacy records (written before records named their model and settings), "
                "so nothing shows they belong to this run; write to another --out, or move the file away to start "
                "over (summarizing them without computing, compute=False / accuracy.py --no-run, still works)")
        if legacy:
            self.legacy = True
            label = "reasoning" if config["suite"] == "jsonl" else config["suite"]  # the jsonl suite's legacy label
            current = [r for r in legacy if r.get("suite") == label]
        for record in current:
            self.records[(record["method"], record["key"])] = record

    def _foreign(self, recorded: dict) -> str:
        model = self.config["model"]["name"]
        return (f"{self.path} holds results of another configuration than this run ({model}, suite "
                f"{self.config['suite']}): {'; '.join(config_differences(recorded, self.config))} (recorded -> now); "
                "resuming would mix them: write to another --out, or remove the file to start over")

    def done(self, method: Method, key: str, item: str | None = None) -> bool:
        """Whether ``(method, key)`` is recorded for this configuration.

        Raises:
            ValueError: it is recorded, but for another definition of the method or another item under that key.
        """
        record = self.records.get((method.name, key))
        if record is None:
            return False
        if self.legacy:
            return True
        if record.get("method_spec") != method_spec(method):
            raise ValueError(f"{self.path}: method {method.name!r} was recorded with another definition (its preset "
                             "or fields changed since); write to another --out, or remove the file to start over")
        if item is not None and record.get("item") != item:
            raise ValueError(f"{self.path}: item {key!r} was recorded for another prompt, budget or checks under the "
                             "same id; write to another --out, or remove the file to start over")
        return True

    def add(self, method: Method, key: str, payload: dict, item: str | None = None) -> None:
        """Append a finished record (flushed to disk at once)."""
        if self.legacy:
            raise RuntimeError("legacy records are read, never added to")
        record = {"suite": self.config["suite"], "method": method.name, "key": key, "run": self.config,
                  "method_spec": method_spec(method), **({} if item is None else {"item": item}), **payload}
        self.records[(method.name, key)] = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def get(self, method: Method, key: str) -> dict:
        """The record of ``(method, key)`` (present: check with `done`)."""
        return self.records[(method.name, key)]

    def of(self, method: Method, keys: set[str] | None = None) -> list[dict]:
        """The records of ``method`` (those with a key in ``keys`` if given), in the order they were written."""
        return [r for (name, key), r in self.records.items() if name == method.name and (keys is None or key in keys)]


def merge_records(into: Path, source: Path) -> tuple[int, int]:
    """Append to ``into`` the records of ``source`` it lacks: one grid run as several processes (one a core, each
    with its own ``--out``), gathered into one file. Both must hold records of one configuration (the model's
    weights and the suite's settings; `config_differences`).

    Returns:
        ``(added, shared)``: records appended, and records both files held (each must agree field by field but
        its ``run.model.name``: the same method on the same item and weights gives the same verdict).

    Raises:
        ValueError: the files are of different configurations, or a shared record differs (the message names it).
    """
    def read(path: Path) -> dict[tuple[str, str], dict]:
        records = read_records(path)
        if any("run" not in record for record in records):
            raise ValueError(f"{path} holds legacy records (no run configuration): they cannot be merged")
        return {(record["method"], record["key"]): record for record in records}

    ours, theirs = read(into), read(source)
    configs = [r["run"] for r in (*ours.values(), *theirs.values())]
    for config in configs[1:]:
        if differences := config_differences(configs[0], config):
            raise ValueError(f"{source} and {into} hold results of different configurations: {'; '.join(differences)}")
    added, shared = [], 0
    for key, record in theirs.items():
        if key not in ours:
            added.append(record)
            continue
        shared += 1
        mine = ours[key]
        fields = sorted(k for k in mine.keys() | record.keys() if k != "run" and mine.get(k) != record.get(k))
        if fields:
            raise ValueError(f"{key[0]} on {key[1]} differs between {source} and {into} in {', '.join(fields)}")
    if added:
        with into.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in added)
    return len(added), shared


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from a bundled reference model name (``mla``, ``gqa``, ``mha``), a local directory, or
    a hub name already in the local cache (no downloads). An MLA model attends through `kvarn_mla.use_padded_sdpa`."""
    from .. import reference_models
    from ..patch import use_padded_sdpa

    if name in reference_models.NAMES:
        return reference_models.load(name, dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except OSError as error:
        raise ValueError(f"cannot load model {name!r} offline: give {reference_models.NAMES}, a local directory, "
                         f"or a hub name in the local cache ({error})") from None
    use_padded_sdpa(model)
    return model.eval(), tokenizer


def default_text(tokenizer, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of held-out real text: the Python standard library files the reference models never saw."""
    from .data import read_code_files

    ids: list[int] = []
    for code in read_code_files("held_out"):
        ids += tokenizer(code.text + (tokenizer.eos_token or ""), add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            break
    if len(ids) < tokens:
        raise ValueError(f"the held-out text has only {len(ids)} tokens, fewer than the {tokens} asked for")
    return torch.tensor([ids[:tokens]])


def run(
    model,
    tokenizer,
    methods: list[Method],
    suite: str,
    out: Path,
    *,
    text_ids: torch.Tensor | None = None,
    tokens: int = 2048,
    chunk: int = 128,
    greedy_tokens: int = 1024,
    greedy_prompt: torch.Tensor | None = None,
    items: list | None = None,
    batch_size: int = 8,
    sampling: dict | None = None,
    context: int = 1024,
    seed: int | None = None,
    tasks_digest: str | None = None,
    model_name: str | None = None,
    compute: bool = True,
    mode: str = "greedy",
) -> dict:
    """Run ``suite`` for every method, resuming from ``out.jsonl``, and write the summary to ``out``.

    Args:
        model, tokenizer: The unpatched model (methods patch it temporarily) and its tokenizer.
        methods: Methods to compare; the reference among them is labelled by the model's dtype
            (`with_reference_label`: ``fp32`` for a float32 model).
        suite: ``accumulation``, ``reasoning``/``retrieval``/``jsonl`` (``items`` to generate), or ``worst-vectors``.
        out: Summary path; records go to ``out`` with suffix ``.jsonl``.
        text_ids: ``[1, T]`` text for accumulation/worst-vectors (default: held-out code, ``tokens`` long).
        chunk: Chunk size of the accumulation protocol (the tile size).
        greedy_tokens: Length of the free-running greedy comparison.
        greedy_prompt: ``[1, P]`` prompt of that comparison (default: the first 512 tokens of the text).
        items: `GenerationItem` list for the generation suites.
        sampling: ``generate`` sampling arguments (default greedy).
        context: Cached tokens for worst-vectors (the rest of the text is scored); the retrieval items' length.
        seed: The seed the caller set for sampling (and, for retrieval, made the items with); recorded when it
            changes results: when sampling, and for retrieval.
        tasks_digest: `file_digest` of the task file the ``jsonl`` items were read from (their answers).
        model_name: How the model was named (``--model``), for messages; the model is identified by its weights.
        compute: False only summarizes the records already in ``out.jsonl`` (a stopped run's partial table; also
            legacy records, see the module docstring).
        mode: How generation suites score an item: ``"greedy"`` (generate, then run its checks) or
            ``"teacher-forced"`` (`teacher_forced_grid`: the headline ``exact`` verdict only, from a few forward
            passes over the target, item by item with one prefill shared by the KVarN methods; needs items with a
            target and greedy sampling).

    Raises:
        ValueError: ``out.jsonl`` holds records of another configuration (or legacy records and ``compute``).
    """
    from .accumulation import accumulation_curve, greedy_divergence, reference_greedy
    from .tasks import generate_items, teacher_forced_grid
    from .worst import worst_vectors

    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; allowed: {SUITES}")
    out = Path(out)
    sampling = {"do_sample": False} if sampling is None else sampling
    check_mode(mode, suite, sampling)
    if suite in ("accumulation", "worst-vectors") and text_ids is None:
        text_ids = default_text(tokenizer, tokens)
    if suite == "accumulation" and greedy_prompt is None:
        greedy_prompt = text_ids[:, :GREEDY_PROMPT]
    identity = model_identity(model, model_name)
    config = run_config(suite, identity, suite_settings(
        suite, text_ids=text_ids, chunk=chunk, greedy_tokens=greedy_tokens, greedy_prompt=greedy_prompt,
        batch_size=batch_size, sampling=sampling, context=context, seed=seed, tasks_digest=tasks_digest, mode=mode))
    out.parent.mkdir(parents=True, exist_ok=True)
    log = ResultLog(out.with_suffix(".jsonl"), config, compute=compute)
    label_dtype = LEGACY_REFERENCE_DTYPE if log.legacy else identity["dtype"]
    methods = with_reference_label(methods, label_dtype)
    reference = Method(reference_label(label_dtype), "reference")
    keys = None if items is None else {it.id for it in items}
    if compute and mode == "teacher-forced":  # item by item, the KVarN methods sharing each item's prefill
        digests = {it.id: item_digest(it) for it in items}

        def done(method: Method, item) -> bool:  # asked before an item is scored, never after
            return log.done(method, item.id, digests[item.id])

        progress = tqdm(total=sum(not done(m, it) for it in items for m in methods),
                        desc=f"{suite} (teacher-forced)", unit="score")
        for method, record in teacher_forced_grid(model, tokenizer, items, methods, skip=done):
            log.add(method, record["id"], record, item=digests[record["id"]])
            progress.update()
        progress.close()
    for method in tqdm(methods if compute and mode == "greedy" else [], desc=f"{suite}", unit="method"):
        if suite == "accumulation":
            if method.kind == "reference":
                continue
            if not log.done(method, "curve"):
                static = method.kind == "kvarn" and method.config.tile_size == chunk
                curve = accumulation_curve(model, text_ids, method, chunk, static=static)
                log.add(method, "curve", {"curve": curve})
            if not log.done(method, "greedy"):
                if not log.done(reference, "greedy-tokens"):  # one reference run serves every method
                    log.add(reference, "greedy-tokens",
                            {"tokens": reference_greedy(model, greedy_prompt, greedy_tokens).tolist()})
                tokens_reference = torch.tensor(log.get(reference, "greedy-tokens")["tokens"],
                                                device=greedy_prompt.device)
                log.add(method, "greedy",
                        greedy_divergence(model, greedy_prompt, method, greedy_tokens, chunk, tokens_reference))
        elif suite == "worst-vectors":
            if method.kind == "kvarn" and not log.done(method, "worst"):
                log.add(method, "worst", worst_vectors(model, text_ids, method, context))
        else:
            digests = {it.id: item_digest(it) for it in items}
            todo = [it for it in items if not log.done(method, it.id, digests[it.id])]
            progress = tqdm(total=len(todo), desc=method.name, unit="item", leave=False)
            for record in generate_items(model, tokenizer, todo, method, batch_size=batch_size, sampling=sampling):
                log.add(method, record["id"], record, item=digests[record["id"]])
                progress.update()
            progress.close()
    summary = summarize(log, methods, suite, model.config, keys)
    summary["settings"] = {"suite": suite, "sampling": sampling, "chunk": chunk, "tokens": int(text_ids.shape[1])
                           if text_ids is not None else None, "greedy_tokens": greedy_tokens, "greedy_prompt_tokens":
                           None if greedy_prompt is None else int(greedy_prompt.shape[1]), "context": context,
                           "mode": mode, "legacy_records": log.legacy}
    summary["run"] = None if log.legacy else config
    out.write_text(json.dumps(summary, indent=1))
    return summary


def check_mode(mode: str, suite: str, sampling: dict) -> None:
    """Refuse a scoring mode that cannot serve ``suite``: teacher-forced scoring gives the greedy exact-match verdict
    of the reasoning and retrieval suites only.

    Raises:
        ValueError: an unknown mode, or teacher-forced with another suite or with sampling.
    """
    from .tasks import MODES

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {MODES}")
    if mode == "teacher-forced" and (suite not in ("reasoning", "retrieval") or sampling.get("do_sample")):
        raise ValueError(f"mode 'teacher-forced' scores greedy exact match of the reasoning and retrieval suites; got "
                         f"suite {suite!r}{' with sampling' if sampling.get('do_sample') else ''} (use --mode greedy)")


def suite_settings(
    suite: str,
    *,
    text_ids: torch.Tensor | None,
    chunk: int,
    greedy_tokens: int,
    greedy_prompt: torch.Tensor | None,
    batch_size: int,
    sampling: dict,
    context: int,
    seed: int | None,
    tasks_digest: str | None,
    mode: str = "greedy",
) -> dict:
    """The settings of ``suite`` that change its results (see `run` for the arguments); the others are left out,
    so that changing them does not block a resume. The mode is named only when it is not greedy, so records
    written before there were modes still resume."""
    if suite == "accumulation":
        return {"text": tensor_digest(text_ids), "text_tokens": int(text_ids.shape[1]), "chunk": chunk,
                "greedy_prompt": tensor_digest(greedy_prompt), "greedy_prompt_tokens": int(greedy_prompt.shape[1]),
                "greedy_tokens": greedy_tokens}
    if suite == "worst-vectors":
        return {"text": tensor_digest(text_ids), "text_tokens": int(text_ids.shape[1]), "context": context}
    settings = {"sampling": sampling, "batch_size": batch_size,
                "seed": seed if sampling.get("do_sample") or suite == "retrieval" else None}
    if mode != "greedy":
        settings["mode"] = mode
        del settings["batch_size"]  # one item at a time
    if suite == "retrieval":
        settings["context"] = context
    if suite == "jsonl":
        settings["tasks"] = tasks_digest
    return settings


def summarize(log: ResultLog, methods: list[Method], suite: str, model_config, keys: set[str] | None = None) -> dict:
    """Per-method summary of the records in ``log`` (of the generation items ``keys`` only, if given)."""
    rows = {}
    for method in methods:
        records = log.of(method, keys)
        if suite in ("reasoning", "retrieval", "jsonl") and records:
            checks = [k for k in records[0] if k not in _NOT_CHECKS]
            row = {"n": len(records)}
            for check in checks:
                correct = sum(bool(r[check]) for r in records)
                low, high = wilson_interval(correct, len(records))
                row[check] = {"correct": correct, "accuracy": correct / len(records), "ci95": [low, high]}
            row["mean_new_tokens"] = statistics.mean(r["new_tokens"] for r in records)
        elif suite == "accumulation" and method.kind != "reference" and records:
            row = {}
            for record in records:
                if record["key"] == "curve":
                    curve = record["curve"]
                    row["kl_last"] = curve[-1]["kl"]
                    row["kl_mean"] = statistics.mean(c["kl"] for c in curve)
                    row["top1_mean"] = statistics.mean(c["top1"] for c in curve)
                    row["kl_curve"] = [c["kl"] for c in curve]
                    if "kl_static" in curve[-1]:
                        row["kl_last_static"] = curve[-1]["kl_static"]
                        row["kl_curve_static"] = [c["kl_static"] for c in curve]
                    row["attn_err_last"] = curve[-1]["attn_err"]
                elif record["key"] == "greedy":
                    row.update({k: v for k, v in record.items() if k not in _META})
        elif suite == "worst-vectors" and records:
            row = {k: v for k, v in records[0].items() if k not in _META}
        else:
            continue
        tokens = 4096
        per_token = method.bytes_per_token(model_config, tokens)
        row["bytes_per_token_4k"] = per_token
        rows[method.name] = row
    return {"suite": suite, "methods": rows}
