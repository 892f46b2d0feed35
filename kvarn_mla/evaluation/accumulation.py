"""The paper's pseudo-decode protocol: does quantization error accumulate over a long sequence?

A text is processed in chunks of the tile size, each chunk attending everything before it through the method's
cache. Three runs go in lockstep, chunk by chunk:

* reference: the unpatched model with its 16-bit ``DynamicCache``;
* accumulated: the method's cache filled by the method's own forward passes, so each chunk's K/V inherit the
  error of the quantized chunks before it;
* static: the method's cache filled with the *reference* K/V of the earlier chunks (quantized once, no
  inheritance), so any difference to "accumulated" is error that compounded.

Per chunk: KL divergence of next-token distributions against the reference, top-1 agreement, and the relative
error of every layer's attention output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from ..adapters import adapter_for
from .methods import Method


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(p_ref || p)`` in nats, from logits ``[..., V]`` (computed in float64)."""
    log_ref = torch.log_softmax(reference_logits.double(), -1)
    log_p = torch.log_softmax(logits.double(), -1)
    return (log_ref.exp() * (log_ref - log_p)).sum(-1)


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules, in layer order (the ones `kvarn_mla.patch` takes over)."""
    adapter = adapter_for(model.config)
    return [m for m in model.get_decoder().modules() if adapter.is_attention(m)]


@contextlib.contextmanager
def capture_attention(model) -> Iterator[list]:
    """Collect each attention module's output (``[B, S, hidden]``) of the forward passes run inside."""
    outputs: list = []
    handles = [m.register_forward_hook(lambda module, args, out: outputs.append(out[0].float()))
               for m in attention_modules(model)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _forward(model, chunk: torch.Tensor, cache) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with capture_attention(model) as outputs:
        logits = model(chunk, cache=cache, use_cache=True).logits.float()
    return logits, list(outputs)


def _stats(reference, other) -> dict:
    (ref_logits, ref_attention), (logits, attention) = reference, other
    return {
        "kl": float(kl_divergence(ref_logits, logits).mean()),
        "top1": float((ref_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
        "attn_err": [float((a - r).norm() / r.norm().clamp(min=1e-30)) for a, r in zip(attention, ref_attention)],
    }


def _append_reference(cache, reference_cache, start: int, end: int) -> None:
    """Put the reference K/V of tokens ``[start, end)`` into ``cache`` and quantize what filled."""
    for layer, ref in zip(cache.layers, reference_cache.layers):
        layer.update(ref.keys[:, :, start:end], ref.values[:, :, start:end])
    cache.flush()


@torch.no_grad()
def accumulation_curve(model, ids: torch.Tensor, method: Method, chunk: int, static: bool = True) -> list[dict]:
    """Per-chunk error of ``method`` against the 16-bit cache over ``ids [1, T]`` (see the module docstring).

    Args:
        model: The (unpatched) model.
        ids: ``[1, T]`` token ids.
        method: A `Method`; "static" needs a KVarN method with tiles aligned to the chunks.
        chunk: Tokens per chunk (the tile size: each chunk then completes one tile).
        static: Also run the static (no inheritance) variant.

    Returns:
        One dict per chunk: ``chunk``, ``start``, ``kl``, ``top1``, ``attn_err`` (per layer), and with ``static``
        the same keys suffixed ``_static``.
    """
    if static and method.kind != "kvarn":
        raise ValueError(f"the static variant needs a KVarN method (it crops its cache), got {method.name!r}")
    if static and (method.config.tile_size != chunk or method.config.sink_tokens % chunk):
        raise ValueError(f"static needs chunk == tile_size ({method.config.tile_size}) and a sink of whole chunks "
                         f"(sink_tokens={method.config.sink_tokens}); got chunk={chunk}")
    reference_cache = DynamicCache(config=model.config)
    with method.applied(model):
        accumulated_cache = method.new_cache(model)
        static_cache = method.new_cache(model) if static else None
    rows = []
    for index, start in enumerate(range(0, ids.shape[1], chunk)):
        end = min(start + chunk, ids.shape[1])
        piece = ids[:, start:end]
        reference = _forward(model, piece, reference_cache)
        row = {"chunk": index, "start": start}
        with method.applied(model):
            row.update(_stats(reference, _forward(model, piece, accumulated_cache)))
            if static:
                result = _forward(model, piece, static_cache)
                static_cache.crop(-(end - start))  # drop this chunk's own K/V; keep the reference's instead
                _append_reference(static_cache, reference_cache, start, end)
                row.update({f"{k}_static": v for k, v in _stats(reference, result).items()})
        rows.append(row)
    return rows


@torch.no_grad()
def greedy_divergence(model, prompt: torch.Tensor, method: Method, new_tokens: int, chunk: int,
                      reference: torch.Tensor | None = None) -> dict:
    """Free-running greedy decoding with the method vs the 16-bit cache.

    Args:
        reference: ``[new_tokens]`` the 16-bit greedy continuation of ``prompt`` if already known (it is the same for
            every method; `reference_greedy` computes it).

    Returns:
        ``first_divergence`` (index of the first generated token that differs, or ``new_tokens`` if none),
        ``agreement`` (fraction of positions of the reference run where the method, fed the reference
        sequence, picks the same top-1 token), and the two generated lengths.
    """
    if reference is None:
        reference = reference_greedy(model, prompt, new_tokens)
    with method.applied(model):
        generated = _greedy(model, prompt, new_tokens, **method.generate_kwargs())
    same = (reference[: len(generated)] == generated[: len(reference)]).tolist()
    first = same.index(False) if False in same else min(len(reference), len(generated))
    # Teacher-forced agreement along the reference run, read through the method's cache chunk by chunk.
    full = torch.cat([prompt[0], reference]).unsqueeze(0)
    with method.applied(model):
        cache = method.new_cache(model)
        predictions = torch.cat([model(full[:, s : s + chunk], cache=cache, use_cache=True).logits[0].argmax(-1)
                                 for s in range(0, full.shape[1] - 1, chunk)])
    targets = full[0, 1:]
    scored = slice(prompt.shape[1] - 1, full.shape[1] - 1)
    agreement = float((predictions[scored] == targets[scored]).float().mean())
    return {"first_divergence": first, "agreement": agreement, "reference_tokens": len(reference),
            "method_tokens": len(generated)}


def _greedy(model, prompt: torch.Tensor, new_tokens: int, **cache_kwargs) -> torch.Tensor:
    """``[new_tokens]`` greedy continuation of ``prompt [1, P]`` (exactly that many tokens, end of text or not)."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **cache_kwargs)
    return out[0, prompt.shape[1]:]


@torch.no_grad()
def reference_greedy(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``[new_tokens]`` greedy continuation of ``prompt [1, P]`` with the model's own 16-bit cache."""
    return _greedy(model, prompt, new_tokens)
