"""PNG charts of the report (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; the report only writes files
import matplotlib.pyplot as plt  # noqa: E402


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def bar_chart(rows: list[tuple[str, dict]], methods: list[str], path: Path) -> None:
    """Grouped bars: KV bytes per token per model (rows of ``(model, {method: bytes})``) and method."""
    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        axis.bar([i + index * width for i in range(len(rows))], [values[method] / 1024 for _, values in rows],
                 width, label=method)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [name for name, _ in rows], rotation=30,
                    ha="right")
    axis.set_ylabel("KiB per token (all layers)")
    axis.set_yscale("log")
    axis.legend(fontsize=8, ncol=3)
    axis.set_title("KV-cache bytes per token at 32K context")
    _save(figure, path)


def curve_chart(curves: dict[str, tuple[list[float], list[float] | None]], title: str, path: Path) -> None:
    """KL per chunk: accumulated (solid) and static (dashed) for each method."""
    figure, axis = plt.subplots(figsize=(7, 4))
    for index, (method, (accumulated, static)) in enumerate(sorted(curves.items())):
        color = f"C{index}"
        axis.plot(range(len(accumulated)), accumulated, color=color, label=f"{method} accumulated")
        if static:
            axis.plot(range(len(static)), static, color=color, linestyle="--", label=f"{method} static")
    axis.set_xlabel("chunk (128 tokens)")
    axis.set_ylabel("KL to 16-bit (nats)")
    axis.set_yscale("log", nonpositive="mask")  # a KL of exactly 0 (identical distributions) is left out
    axis.set_title(title)
    axis.legend(fontsize=7)
    _save(figure, path)


def merge_close_points(points: list[tuple[str, str, float, float]], x_tolerance: float = 0.02,
                       y_tolerance: float = 0.005) -> list[tuple[str, float, float]]:
    """``(label, bytes, accuracy)`` per group of one family's points that would sit on top of each other (bytes
    within ``x_tolerance`` relative, accuracy within ``y_tolerance``): one label naming them all."""
    groups: list[list[tuple[str, str, float, float]]] = []
    for point in sorted(points, key=lambda p: (p[0], p[2], p[3])):
        for group in groups:
            family, _, x, y = group[0]
            if family == point[0] and abs(point[2] - x) <= x_tolerance * x and abs(point[3] - y) <= y_tolerance:
                group.append(point)
                break
        else:
            groups.append([point])
    return [(", ".join(p[1] for p in group), group[0][2], group[0][3]) for group in groups]


# Label offsets in points, tried in order: beside the point first, then further up and down on either side.
LABEL_OFFSETS = [(dx, sign * (2 + 10 * step) - (7 if sign < 0 else 0)) for step in range(20) for dx in (4, -4)
                 for sign in (1, -1)]


def place_labels(figure, axis, labels: list[tuple[str, float, float]], fontsize: float = 6) -> int:
    """Annotate each ``(text, x, y)`` at the first offset of `LABEL_OFFSETS` where it overlaps no marker and no
    label placed before it (a leader line where it had to move far); returns how many could only overlap."""
    from matplotlib.transforms import Bbox

    renderer = figure.canvas.get_renderer()
    markers = [axis.transData.transform((x, y)) for _, x, y in labels]
    placed, overlapping = [Bbox.from_bounds(px - 3, py - 3, 6, 6) for px, py in markers], 0
    for text, x, y in labels:
        for index, (dx, dy) in enumerate(LABEL_OFFSETS):
            style = dict(xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                         ha="left" if dx > 0 else "right", va="bottom")
            note = axis.annotate(text, (x, y), **style)
            box = note.get_window_extent(renderer)  # the text alone (with a leader line the box would reach the point)
            if not any(box.overlaps(other) for other in placed):
                break
            note.remove()
        else:
            overlapping += 1
            note = axis.annotate(text, (x, y), **style)
        if index > 3:
            note.remove()
            axis.annotate(text, (x, y), arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5"), **style)
        placed.append(box)
    return overlapping


def pareto_chart(points: list[tuple[str, str, float, float]], path: Path) -> None:
    """Reasoning accuracy vs bytes per token, one marker style per family; points are (family, method, B, acc).
    Points that coincide share one label; labels are moved until they do not overlap."""
    figure, axis = plt.subplots(figsize=(12, 8))
    markers = {"MHA": "o", "GQA": "s", "MLA": "^"}
    for family in sorted({p[0] for p in points}):
        mine = [p for p in points if p[0] == family]
        axis.scatter([p[2] for p in mine], [100 * p[3] for p in mine], marker=markers.get(family, "x"),
                     label=family, s=30)
    axis.set_xscale("log")
    axis.set_xlabel("KV bytes per token at 4K (all layers)")
    axis.set_ylabel("reasoning exact match (%)")
    axis.set_title("Reasoning accuracy vs cache bytes")
    axis.legend()
    figure.tight_layout()
    figure.canvas.draw()  # fixes the layout, so label boxes are measured where they will be drawn
    place_labels(figure, axis, [(label, x, 100 * y) for label, x, y in merge_close_points(points)])
    figure.savefig(path, dpi=110)
    plt.close(figure)


def speed_chart(rows: list[dict], path: Path) -> None:
    """Decode ms per step vs context, stock (dashed) vs k4v2 (solid), per family."""
    figure, axis = plt.subplots(figsize=(7, 4))
    for index, family in enumerate(sorted({r["family"] for r in rows})):
        mine = sorted((r for r in rows if r["family"] == family), key=lambda r: r["context"])
        contexts = [r["context"] for r in mine]
        axis.plot(contexts, [r["stock_decode_ms"] for r in mine], f"C{index}--", label=f"{family} stock")
        axis.plot(contexts, [r["k4v2_decode_ms"] for r in mine], f"C{index}-", marker="o", label=f"{family} k4v2")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("context (tokens)")
    axis.set_ylabel("ms per decode step")
    axis.set_title("Decode step time on CPU")
    axis.legend(fontsize=8)
    _save(figure, path)


def context_chart(curves: dict[str, list[tuple[int, int, int]]], title: str, xlabel: str, path: Path) -> None:
    """Exact match vs context (or length) per method, ``curves = {method: [(x, correct, n)]}``, with Wilson 95%
    bars; one panel per bit width (methods without bits, such as the reference, in every panel, dashed). A method
    family (``kvarn``, ``rot``, ...) has the same colour in every panel."""
    import re

    from ..evaluation.checkers import wilson_interval
    from ..evaluation.paired import bits_of

    family_of = {m: re.sub(r"-\d(?=\+|$)", "", m) for m in curves}
    colour = {family: f"C{i % 10}" for i, family in enumerate(dict.fromkeys(family_of.values()))}
    xs_all = sorted({x for points in curves.values() for x, _, _ in points})
    widths = sorted({b for m in curves if (b := bits_of(m))}) or [None]
    figure, axes = plt.subplots(1, len(widths), figsize=(max(6.5, 4.2 * len(widths)), 3.8), sharey=True, squeeze=False)
    for axis, bits in zip(axes[0], widths):
        for method in (m for m in curves if bits_of(m) in (bits, None)):
            points = sorted(curves[method])
            ys = [c / n for _, c, n in points]
            bounds = [wilson_interval(c, n) for _, c, n in points]
            errors = [[y - low for y, (low, _) in zip(ys, bounds)], [high - y for y, (_, high) in zip(ys, bounds)]]
            axis.errorbar([x for x, _, _ in points], ys, yerr=errors, fmt="o-" if bits_of(method) else "o--",
                          color=colour[family_of[method]], capsize=2, markersize=3, linewidth=1, label=method)
        if xs_all and xs_all[0] > 0:  # contexts double: even spacing
            axis.set_xscale("log", base=2)
        axis.set_xticks(xs_all, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs_all])
        axis.minorticks_off()
        axis.set_title(f"{bits}-bit" if bits else "methods", fontsize=9)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.legend(fontsize=6)
    axes[0][0].set_ylabel("exact match")
    axes[0][0].set_ylim(-0.03, 1.03)
    figure.suptitle(title, fontsize=10)
    _save(figure, path)
