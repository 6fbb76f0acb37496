"""Documents of the local lm-eval tasks (`llada_tasks`, `llada_choice`): the embedded model's held-out task
suite (`llada_jax.training.tasks`), built in memory, so the tasks run with no dataset download."""

from __future__ import annotations

from llada_jax.training.tasks import held_out

DISTRACTORS = 3


def held_out_docs(per_family: int = 100, **_):
    """`{"test": [{family, prompt, answer}, ...]}` as a `datasets.DatasetDict`, interleaving the families."""
    import datasets  # lm-eval's own dependency: only needed when lm-eval runs

    examples = held_out(per_family)
    by_family: dict[str, list] = {}
    for example in examples:
        by_family.setdefault(example.family, []).append(example)
    rows = [{"family": e.family, "prompt": e.prompt, "answer": e.answer}
            for group in zip(*by_family.values()) for e in group]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def choice_docs(per_family: int = 100, **_):
    """The held-out tasks as multiple choice: the answer among the answers of the next examples of its family,
    at position (index mod choices) so no position is favoured."""
    import datasets

    docs = held_out_docs(per_family)["test"].to_list()
    rows = []
    for index, doc in enumerate(docs):
        same = [other["answer"] for other in docs[index + 1:] + docs[:index]
                if other["family"] == doc["family"] and other["answer"] != doc["answer"]]
        choices = list(dict.fromkeys(same))[:DISTRACTORS]
        gold = index % (len(choices) + 1)
        choices.insert(gold, doc["answer"])
        rows.append({**doc, "choices": choices, "gold": gold})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
