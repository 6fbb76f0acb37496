"""`llada trace`: a picture of one generation's trajectory - which step committed (and revised) each token."""

from __future__ import annotations

import numpy as np

from eval.figure_file import save_png


def commit_grid(result, gen_length: int) -> tuple[np.ndarray, np.ndarray, list]:
    """(step that first committed each generated position, whether it was a draft, revision points)."""
    committed_at = np.full(gen_length, -1)
    drafted = np.zeros(gen_length, bool)
    revisions = []
    for record in result.trace:
        first_draft = len(record.positions) - record.drafts
        for index, position in enumerate(record.positions):
            committed_at[position - result.prompt_len] = record.nfe
            drafted[position - result.prompt_len] = index >= first_draft
        revisions += [(position - result.prompt_len, record.nfe) for position, _, _ in record.revisions]
    return committed_at, drafted, revisions


def plot_trace(result, tokens: list[str], path, title: str = "", force: bool = False) -> None:
    """One column per generated token, one row per dense step; a cell is filled from its commit step on."""
    import matplotlib  # heavy (~0.4 s) and only for `llada trace`

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    gen_length = len(result.output_ids)
    committed_at, drafted, revisions = commit_grid(result, gen_length)
    steps = max(result.nfe, 1)
    filled = np.arange(steps)[:, None] >= committed_at[None, :]
    figure, axes = plt.subplots(figsize=(max(6, gen_length * 0.28), max(3, steps * 0.18 + 1.5)))
    axes.imshow(np.where(filled, 1.0, 0.0), aspect="auto", cmap="Greys", vmin=0, vmax=2.5, origin="upper")
    axes.scatter(np.arange(gen_length), committed_at, c=np.where(drafted, "tab:orange", "tab:blue"), s=18,
                 label="committed (orange: early draft)")
    if revisions:
        axes.scatter([p for p, _ in revisions], [s for _, s in revisions], marker="x", c="tab:red", s=30,
                     label="revised")
    axes.set_xticks(np.arange(gen_length))
    axes.set_xticklabels(tokens, fontsize=7)
    axes.set_xlabel("generated position (final token)")
    axes.set_ylabel("dense step")
    axes.set_title(title or f"{result.nfe} steps")
    axes.legend(loc="lower right", fontsize=7)
    figure.tight_layout()
    figure.set_dpi(110)
    save_png(figure, path, "llada trace", force)
    plt.close(figure)
