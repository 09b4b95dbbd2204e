"""Hook specifications: what a plugin can contribute.

Every hook receives a ``register`` callable owned by the core; the plugin
calls it once per thing it contributes. The core records which plugin
registered what, so duplicates and ``fv plugins`` can name the plugin.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("fv")
hookimpl = pluggy.HookimplMarker("fv")

Register = Callable[..., None]


@hookspec
def fv_register_cards(register: Register) -> None:
    """Contribute model cards.

    :param register: call ``register(card)`` with a ``ModelCard`` or a
        ``CardVariant`` (a registered card with its own id and defaults), or with a
        zero-argument callable (or lazy ``"module:attr"`` string) returning one
        (the card's ``model_id`` is its key); or ``register(model_id, factory)``
        to key it without building the card.
    """


@hookspec
def fv_register_kernels(register: Register) -> None:
    """Contribute kernels for an op.

    :param register: call ``register((op, device, arch, variant), impl)``, e.g.
        ``(("attention", "any", "any", "sta"), "fv_sta.kernel:sta_attention")``;
        ``arch`` is a GPU architecture (``"sm90"``) or ``"any"``. ``impl`` must take
        the op's call signature (``fv_core.kernels.SIGNATURES``), checked when it
        registers (a lazy string: when it is first imported).
    """


@hookspec
def fv_register_interceptors(register: Register) -> None:
    """Contribute step/block interceptors and observers.

    :param register: call ``register(name, factory)`` where ``factory`` is a
        callable or lazy ``"module:attr"`` string; the deploy file enables
        interceptors by this name.
    """


@hookspec
def fv_register_methods(register: Register) -> None:
    """Contribute training methods.

    :param register: call ``register(name, factory)`` where ``factory`` is a
        callable or lazy ``"module:attr"`` string returning a training method.
    """


@hookspec
def fv_register_trainers(register: Register) -> None:
    """Contribute a model family's training adapter (``fv_core.training.TrainAdapter``).

    :param register: call ``register(family, adapter)`` where ``adapter`` (a class or lazy
        ``"module:attr"`` string) is built as ``adapter(loaded_model)``; ``family`` is the
        ``ModelCard.family`` it serves.
    """


@hookspec
def fv_register_rewards(register: Register) -> None:
    """Contribute reward models for training methods (``fv_core.training.Reward``).

    :param register: call ``register(name, factory)`` where ``factory`` (a callable or lazy
        ``"module:attr"`` string) returns a reward: ``reward(frames, prompts) -> tensor [B]``.
    """


@hookspec
def fv_register_scorers(register: Register) -> None:
    """Contribute scorers: models that score artifacts, for workflows that keep the best of N candidates.

    :param register: call ``register(name, factory)`` where ``factory`` (a callable or lazy
        ``"module:attr"`` string) is built with a workflow stage's ``select`` options and returns a
        scorer: ``scorer(frames [B, F, H, W, 3] in 0..1, prompts) -> tensor [B]`` (higher: better).
    """


@hookspec
def fv_register_workflows(register: Register) -> None:
    """Contribute cross-model workflows (``fv_core.workflow.WorkflowSpec``).

    :param register: call ``register(workflow_id, spec)`` where ``spec`` is a WorkflowSpec, its dict, or a
        callable / lazy ``"module:attr"`` string returning one. Its stages name card ids as models; a
        deploy file serves it with ``workflows: {ID: registered-id}`` (each stage runs on the served model
        of that card), and ``fv_core.load(workflow_id)`` alone serves the cards it names.
    """


@hookspec
def fv_register_datasets(register: Register) -> None:
    """Contribute datasets of real videos for training methods (``fv_core.training.Dataset``).

    :param register: call ``register(name, factory)`` where ``factory`` (a callable or lazy
        ``"module:attr"`` string) returns a dataset: ``dataset.batch(seed, index, size)`` gives videos
        [B, 3, F, H, W] in -1..1 and their captions.
    """


@hookspec
def fv_register_options(register: Register) -> None:
    """Contribute the pydantic schema of this plugin's options.

    :param register: call ``register(plugin_name, schema)`` with a pydantic
        model class (``extra="forbid"``); deploy files and requests set the
        plugin's options only through it.
    """


@hookspec
def fv_register_pipelines(register: Register) -> None:
    """Contribute readers of checkpoint folders, keyed by their ``model_index.json`` class.

    :param register: call ``register(pipeline_class, family)``, e.g.
        ``("WanPipeline", "fv_wan.folder:WanFolder")``; ``family.card(folder)``
        builds a card from the folder's own configs (``fv_core.load(folder)``) and
        ``family.bind(card, folder)`` adapts a named card to a folder it runs on
        (e.g. its default sampler follows the folder's scheduler). A family whose
        published layout has no ``model_index.json`` (BAGEL's) also gives
        ``family.recognizes(folder) -> bool``; such folders are offered to it.
    """


@hookspec
def fv_register_commands(register: Register) -> None:
    """Contribute ``fv`` subcommands.

    :param register: call ``register(name, add_parser)`` where ``add_parser``
        (a callable or lazy ``"module:attr"`` string) takes argparse's
        subparsers, adds the ``name`` subcommand and sets its ``func``.
    """


@hookspec
def fv_register_fleets(register: Register) -> None:
    """Contribute fleets: many fv servers behind one OpenAI-compatible endpoint (``fv serve --NAME``).

    :param register: call ``register(name, run)`` where ``run`` (a callable or lazy
        ``"module:attr"`` string) is ``run(deploy_file, host=, port=, data_dir=, api_key=, device=,
        address=) -> exit code``: it starts the fleet the deploy file describes behind ``host:port``
        and returns once it stopped; ``address`` is the cluster to join (None: the engine's default).
        ``name`` is the ``fv serve`` flag that selects it (``"ray"``: ``fv serve --ray``).
    """


HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, value in list(globals().items()) if name.startswith("fv_register_") and callable(value)
)

__all__ = ["HOOK_NAMES", "Register", "hookimpl", "hookspec"] + list(HOOK_NAMES)
