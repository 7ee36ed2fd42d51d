"""``dsgpt2 chat``: a dialogue with a conversation-finetuned model.

The history is formatted as in finetuning (:mod:`dsgpt2.data.conversation`) and
ends with the bot's speaker token; the reply stops at end-of-text or at the
next speaker token. When the history and the reply would not fit the
context, the oldest turns are dropped first. Lines starting with ``/`` are
commands: ``/reset`` forgets the history, ``/quit`` ends the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from dsgpt2.data.conversation import prompt_ids, speaker_ids
from dsgpt2.documents import utf8_encodable
from dsgpt2.errors import ConfigError
from dsgpt2.infer.generate import Generator, SamplingParams

HELP = "commands: /reset forgets the conversation, /quit ends it"


class ChatSession:
    """One conversation: the turns so far and how to ask for the next reply."""

    def __init__(
        self, generator: Generator, params: SamplingParams, user: str = "user", bot: str = "bot"
    ) -> None:
        self.generator = generator
        self.params = params
        task = generator.loaded.run.get("task")
        if task is not None and task != "conversation":
            # Its tokenizer may hold the speaker tokens (`vocab train` adds them), never learned.
            raise ConfigError(
                f"{generator.loaded.name} was trained on text (its task: {task}), not on conversations: it "
                "continues text, it does not answer; finetune it first (dsgpt2 train --task conversation "
                f"--init_from {generator.loaded.name} ...)"
            )
        self.speakers = speaker_ids(generator.tokenizer)
        for name in (user, bot):
            if name not in self.speakers:
                raise ConfigError(
                    f"speaker {name!r} has no <|{name}|> token in {generator.loaded.tokenizer_dir} "
                    f"(it has {sorted(self.speakers) or 'none'}); a chat model needs a tokenizer "
                    "trained with `dsgpt2 vocab train --speakers ...`"
                )
        self.user, self.bot = user, bot
        self.history: list[dict[str, str]] = []
        self.last_prompt_tokens = 0
        self.last_dropped_turns = 0
        self._turn = 0

    def reset(self) -> None:
        self.history = []

    def prompt(self, turns: list[dict[str, str]], system: str = "") -> list[int]:
        """The prompt for the bot's next turn: the latest turns that leave room for a reply, ``system``
        (instructions) before the first user turn kept, however many older ones are dropped. One turn
        alone too long keeps its text's end, after its speaker token and the system text. Linear in the
        conversation: each text is tokenized once, in one call.

        Raises:
            ConfigError: the system text alone leaves no room for the turn and the reply.
        """
        budget = self.generator.context - self.params.max_new_tokens
        texts = [t["text"] for t in turns] + ([f"{system}\n\n"] if system else [])
        encoded = [e.ids for e in self.generator.tokenizer.encode_batch(texts, add_special_tokens=False)]
        system_ids = encoded.pop() if system else []
        # The first user turn from each turn on (where the system text goes), and each turn's length.
        first_user: list[int | None] = [None] * (len(turns) + 1)
        for i in range(len(turns) - 1, -1, -1):
            first_user[i] = i if turns[i]["speaker"] == self.user else first_user[i + 1]
        length = 1 + sum(1 + len(ids) for ids in encoded)  # every turn, then the bot's speaker token
        start = 0
        while start < len(turns) - 1:
            if length + (len(system_ids) if first_user[start] is not None else 0) <= budget:
                break
            length -= 1 + len(encoded[start])
            start += 1
        self.last_dropped_turns = start
        kept, kept_ids = turns[start:], encoded[start:]
        at = first_user[start] if turns else None
        if at is not None and system_ids:
            kept_ids[at - start] = system_ids + kept_ids[at - start]
        ids = prompt_ids(kept, kept_ids, self.speakers, self.bot)
        over = len(ids) - budget
        if over <= 0:
            return ids
        # One turn left, too long: its text's end, after its speaker token and any system text.
        head = 1 + (len(system_ids) if at is not None else 0)  # the speaker token and the system text
        if head > 1 and head + 1 >= budget:
            raise ConfigError(
                f"the system text takes {len(system_ids)} tokens: with max_tokens "
                f"{self.params.max_new_tokens} it leaves no room in the model's context of "
                f"{self.generator.context} tokens for the conversation"
            )
        if head + 1 >= budget:  # not even one token of text fits: the end of it all
            return ids[-budget:] if budget > 0 else ids
        return [*ids[:head], *ids[head + over :]]

    def reply(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """Add the user's ``text``, generate the bot's answer, add it too, and return it;
        ``on_text`` receives the answer's text as it comes."""
        turns = [*self.history, {"speaker": self.user, "text": text}]
        ids = self.prompt(turns)
        self.last_prompt_tokens = len(ids)
        # Each turn samples with its own seed, so that a session replays identically.
        params = replace(self.params, num_samples=1, seed=self.params.seed + self._turn)
        self._turn += 1
        stops = list(self.speakers.values())
        answer = self.generator.generate_ids(ids, params, stops, on_text, strip=True)[0].text
        self.history = [*turns, {"speaker": self.bot, "text": answer}]
        return answer


def run_chat(
    session: ChatSession, lines: Iterable[str], interactive: bool, write: Callable[[str], None]
) -> None:
    """Answer each input line, passing what to print to ``write`` (answers as they come).
    Ends at ``/quit`` or the end of input."""
    if interactive:
        write(f"chatting with {session.generator.loaded.name}; {HELP}\n")
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        if line == "/quit":
            return
        if line == "/reset":
            session.reset()
            write("(conversation reset)\n")
        elif line.startswith("/"):
            write(f"(unknown command {line.split()[0]}; {HELP})\n")
        elif not utf8_encodable(line):  # bytes stdin could not decode
            if not interactive:
                raise ConfigError(
                    f"the input holds a line that is not UTF-8 text: {line[:40]!r}; save it as UTF-8"
                )
            write("(that line is not UTF-8 text; type it again)\n")
        else:
            write(f"{session.bot}: ")
            session.reply(line, on_text=write)
            write("\n")
