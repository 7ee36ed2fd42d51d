"""HellaSwag: pick the right one of four endings, the benchmark GPT-2 runs are compared by.

The user supplies the file in the layout llm.c downloads (``hellaswag_val.jsonl``: one object per
line with ``ctx``, ``endings`` (four strings) and ``label``). Each ending is scored by the model's
loss on its tokens after the context, as llm.c's script does: ``acc`` picks the ending with the
least summed loss, ``acc_norm`` the least mean loss per token (for reference, llm.c reports
OpenAI's GPT-2 124M at 28.6 % / 29.6 % this way; chance is 25 %).

Used by ``dsgpt2 evaluate --hellaswag`` and by training (``--hellaswag``): every rank scores its
share of the examples and the counts are summed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.files import not_a_file

ENDINGS = 4


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]
    label: int


def read_examples(path: Path, limit: int | None = None) -> list[Example]:
    """The examples of a HellaSwag JSONL file; a malformed file is one line naming the line."""
    path = Path(path)
    why = not_a_file(path)
    if why is not None:
        raise ConfigError(f"--hellaswag {path}: {why}")
    try:
        return _read(path, limit)
    except UnicodeDecodeError:
        raise ConfigError(f"--hellaswag {path}: not JSON lines (its bytes are not UTF-8 text)") from None
    except OSError as exc:
        raise ConfigError(f"--hellaswag {path}: cannot read it ({exc.strerror})") from None


def _read(path: Path, limit: int | None) -> list[Example]:
    out: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                endings = obj["endings"]
                label = obj["label"]
                ctx_ok = isinstance(obj["ctx"], str) and obj["ctx"].strip() != ""
                endings_ok = isinstance(endings, list) and len(endings) == ENDINGS
                endings_ok = endings_ok and all(isinstance(e, str) for e in endings)
                ok = ctx_ok and endings_ok and int(label) in range(ENDINGS)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise ConfigError(
                    f"--hellaswag {path}: line {number} is not a HellaSwag example (ctx, four endings, "
                    "label 0-3; the layout of llm.c's hellaswag_val.jsonl)"
                )
            out.append(Example(obj["ctx"], tuple(endings), int(label)))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ConfigError(f"--hellaswag {path}: no example in the file")
    return out


def rows(example: Example, encode: Any, context: int) -> list[tuple[list[int], int]]:
    """Each ending's tokens after the context's, and where the ending starts; the context is cut
    from the left when a row would not fit the model."""
    ctx = encode(example.ctx)
    out = []
    for ending in example.endings:
        end = encode(" " + ending)[: context - 1]
        keep = ctx[max(0, len(ctx) - (context - len(end))) :]
        out.append((keep + end, len(keep)))
    return out


def score(
    forward: Any, encode: Any, examples: list[Example], device: Any, context: int, *, batch_examples: int = 4
) -> Any:
    """``[correct, correct_norm, count]`` (a float64 tensor on ``device``) over ``examples``.

    ``forward``: the model or the engine wrapping it; ``encode``: text → token ids.
    """
    import torch

    from dsgpt2.model.gpt2 import span_nll

    total = torch.zeros(3, dtype=torch.float64, device=device)
    for start in range(0, len(examples), batch_examples):
        chunk = examples[start : start + batch_examples]
        built = [r for e in chunk for r in rows(e, encode, context)]
        width = max(len(t) for t, _ in built)
        ids = torch.zeros(len(built), width, dtype=torch.long)
        attention = torch.zeros(len(built), width, dtype=torch.long)
        for i, (tokens, _) in enumerate(built):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            attention[i, : len(tokens)] = 1
        logits = forward(input_ids=ids.to(device), attention_mask=attention.to(device)).logits  # (R, T, V)
        sums, means = [], []
        for i, (tokens, begin) in enumerate(built):
            # Position t predicts token t + 1: the ending's tokens come from positions begin-1 .. n-2.
            target = ids[i, begin : len(tokens)].to(device)
            nll = span_nll(logits[i, begin - 1 : len(tokens) - 1], target)
            sums.append(nll)
            means.append(nll / len(target))
        sums_t = torch.stack(sums).view(len(chunk), ENDINGS)
        means_t = torch.stack(means).view(len(chunk), ENDINGS)
        labels = torch.tensor([e.label for e in chunk], device=device)
        total[0] += (sums_t.argmin(1) == labels).sum()
        total[1] += (means_t.argmin(1) == labels).sum()
        total[2] += len(chunk)
    return total


def encoder(tokenizer_dir: Path) -> Any:
    """text → token ids with the tokenizer of ``tokenizer_dir``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda text: tokenizer.encode(text).ids


def result(total: Any) -> dict[str, float | int]:
    """The summed counts as accuracies."""
    correct, norm, n = (float(x) for x in total.cpu())
    return {"hellaswag_acc": correct / n, "hellaswag_acc_norm": norm / n, "hellaswag_examples": int(n)}


def accuracies(m: dict[str, Any]) -> str:
    """``acc 0.2950, acc_norm 0.3010 over 1000 examples``."""
    return (
        f"acc {m['hellaswag_acc']:.4f}, acc_norm {m['hellaswag_acc_norm']:.4f} "
        f"over {m['hellaswag_examples']} examples"
    )
