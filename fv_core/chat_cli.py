"""``fv chat``: talk to a model's chat task from the terminal, its answer streamed as it is made.

With a message it answers once; without, it reads turns from stdin until end of input, keeping the
conversation (each earlier turn is a text part of the next request, as ``/v1/chat/completions`` sends it).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from fv_core.errors import ConfigError

if TYPE_CHECKING:
    from fv_core.request import Part


def add_chat_parser(sub: Any) -> None:
    chat = sub.add_parser(
        "chat",
        help="chat with a model that answers in text (e.g. a BAGEL card), streaming its answer",
        description="Without MESSAGE, read one turn per line from stdin until end of input.",
    )
    chat.add_argument("message", nargs="?", help="one message to answer (default: read turns from stdin)")
    chat.add_argument("--model", help="card id (see `fv cards`)")
    chat.add_argument(
        "--weights", help="checkpoint folder or Hugging Face id (default: the card's embedded weights)"
    )
    chat.add_argument("--task", help="the card's text task (default: its first that outputs text)")
    chat.add_argument("--image", metavar="PATH", action="append", default=[], help="an image to ask about")
    chat.add_argument("--system", metavar="TEXT", help="text placed before the conversation")
    chat.add_argument("--max-tokens", type=int, help="most new tokens per answer")
    chat.add_argument("--temperature", type=float, help="sampling temperature; 0: greedy")
    chat.add_argument(
        "--think",
        action=argparse.BooleanOptionalAction,
        help="reason inside <think> ... </think> first (default: the card's)",
    )
    chat.add_argument("--seed", type=int, help="seed of the sampling")
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from fv_core.artifacts import TextArtifact
    from fv_core.load import load
    from fv_core.plugins import load_plugins
    from fv_core.request import TextPart, image_part

    host = load_plugins()
    if args.model in host.registries.cards:  # a registered card is checked before its weights load
        text_task(host.card(args.model), args.task)
    model = load(args.model, args.weights, host=host)
    try:
        task = text_task(model.card, args.task)
        params = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "think": args.think,
        }
        params = {k: v for k, v in params.items() if v is not None}
        history: list[Part] = [TextPart(args.system)] if args.system else []
        history += [image_part(path) for path in args.image]
        turns = [args.message] if args.message is not None else _lines()
        for turn in turns:
            answer = model.generate(task=task, parts=history, prompt=turn, on_partial=_print_delta, **params)
            print(flush=True)
            assert isinstance(answer, TextArtifact), f"text_task checked that task {task!r} outputs text"
            history += [TextPart(turn), TextPart(answer.text)]
    finally:
        model.close()
    return 0


def text_task(card: Any, asked: str | None) -> str:
    """``asked`` (else the card's first task that answers in text) when it answers in text; else an error
    naming the card's tasks, what each outputs, and the fix."""
    programs = card.programs
    task = asked or next((t for t, p in programs.items() if p.outputs[0] == "text"), None)
    if task is not None and task in programs and programs[task].outputs[0] == "text":
        return task
    tasks = ", ".join(f"{t} ({p.outputs[0]})" for t, p in programs.items())
    texts = [t for t, p in programs.items() if p.outputs[0] == "text"]
    if asked is None:
        problem = f"{card.model_id!r} has no task that answers in text"
    elif asked not in programs:
        problem = f"{card.model_id!r} has no task {asked!r}"
    else:
        problem = f"task {asked!r} of {card.model_id!r} outputs {programs[asked].outputs[0]}, not text"
    fix = (
        f"chat with --task {' or --task '.join(texts)}"
        if texts
        else f"chat with a model that has a text task (e.g. bagel-tiny, from plugins/fv-bagel), or run this one "
        f"with `fv generate --model {card.model_id} --task {asked if asked in programs else next(iter(programs))}`"
    )
    raise ConfigError(f"fv chat: {problem}; its tasks are {tasks}. Fix: {fix}.", param="task")


def _lines() -> Any:
    """Non-empty lines of stdin, prompting with '> ' when it is a terminal."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _print_delta(partial: Any) -> None:
    print(partial["delta"], end="", flush=True)
