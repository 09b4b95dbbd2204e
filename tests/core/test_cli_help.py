"""`fv --help` starts without torch or plugins; `fv generate --help` is short without --model and shows a
model's params grouped by task with the card's defaults; booleans are switches."""

import subprocess
import sys

import pytest

from fv_core.cli import main


def test_fv_help_imports_neither_torch_nor_a_plugin():
    code = (
        "import sys\nfrom fv_core.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('fv_wan', 'diffusers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def _help(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_generate_help_without_a_model_says_how_to_see_a_models_options(capsys):
    text = _help(["generate", "--help"], capsys)
    assert "fv generate --model CARD --help" in text and "fv cards" in text
    assert "--prompt" not in text and "(default: the card's)" not in text


def test_generate_help_for_a_model_groups_its_params_by_task(capsys):
    text = _help(["generate", "--model", "bagel-tiny", "--help"], capsys)
    assert "task chat (outputs text):" in text and "task t2i (outputs image):" in text
    assert "--think, --no-think" in text
    assert "--num-inference-steps" in text and "(default: 8)" in text
    assert "--frames" not in text  # a Wan param: not bagel-tiny's
    wan = _help(["generate", "--model", "wan2.1-t2v-tiny", "--help"], capsys)
    assert "--frames" in wan and "--think" not in wan and "(default: the card's)" not in wan


def test_think_is_a_switch_in_chat_and_generate(capsys):
    from fv_core.cli import build_parser

    args = build_parser(["chat"]).parse_args(["chat", "hi", "--no-think"])
    assert args.think is False
    argv = ["generate", "--model", "bagel-tiny", "--task", "chat", "--think"]
    assert build_parser(argv).parse_args(argv).think is True
