"""What a run leaves behind: its trained models as Hugging Face directories with their tokenizer files.

``hybridflow train`` ends by writing ``<output_dir>/final/<role>`` for every trained role (actor, and
critic / cost_critic where the algorithm trains one); ``trainer.keep_best`` adds ``<output_dir>/best``;
``hybridflow export RUN_DIR [--step N] [--out DIR]`` turns any checkpoint of a run into the same
directories. Each loads with ``from_pretrained`` and as a ``model.path`` of the next ``hybridflow`` stage.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# Roles whose weights change during RL (the reference, reward and cost models are frozen).
TRAINED_ROLES = ("actor", "critic", "cost_critic")


def role_tokenizer(config, role: str):
    """The tokenizer of a trained role's model (a critic's backbone defaults to the actor's model)."""
    from hybridflow.trainers.build import tokenizer_of

    source = config.section_of(role).model or config.actor.model
    return tokenizer_of(source).load()


def export_roles(groups: dict, config, directory: str | Path, *, merged: bool = False) -> dict[str, Path]:
    """Write ``directory/<role>`` (config, safetensors, tokenizer files) for every trained role in ``groups``.

    A role trained with LoRA writes its adapter in PEFT's format there instead (adapter_config.json +
    adapter_model.safetensors, plus the tokenizer), and the merged model under ``<role>/merged`` when its
    ``lora.export_merged`` or ``merged`` asks for it."""
    written = {}
    for role in TRAINED_ROLES:
        if role in groups:
            written[role] = _export_role(groups[role], config, role, Path(directory) / role, merged=merged)
    return written


def _export_role(group, config, role: str, target: Path, *, merged: bool) -> Path:
    """One role's directory; on a failure (a full disk, ...) the engine's half-written ``<role>.tmp`` is removed, so
    it neither holds the space nor looks like an export."""
    try:
        _write_role(group, config, role, target, merged=merged)
    except BaseException:
        shutil.rmtree(f"{target}.tmp", ignore_errors=True)
        raise
    return target


def _write_role(group, config, role: str, target: Path, *, merged: bool) -> None:
    lora = config.section_of(role).lora
    if lora is None:
        group.export_hf(str(target))
    else:
        group.export_adapter(str(target), base_model=_base_model_path(config, role))
        if merged or lora.export_merged:
            group.export_hf(str(target / "merged"))
            role_tokenizer(config, role).save_pretrained(str(target / "merged"))
    role_tokenizer(config, role).save_pretrained(str(target))


def _base_model_path(config, role: str) -> str | None:
    """The base model directory a role's adapter applies to (None for a tiny or built-in model)."""
    source = config.section_of(role).model or config.actor.model
    return str(Path(source.path).resolve()) if source.path is not None else None


def _single_process_config(plain: dict) -> dict:
    """A run's config with every role on one device (tp = pp = 1): the checkpoint loads into any layout."""
    plain = {**plain, "placement": {"pools": {"global": [1]}, "roles": {}, "mapping": "manual"}}
    for key in ("actor", "critic", "reference", "reward"):
        section = plain.get(key)
        if isinstance(section, dict) and isinstance(section.get("engine"), dict):
            plain[key] = {**section, "engine": {**section["engine"], "tp_size": 1, "pp_size": 1}}
    actor = plain["actor"]
    if isinstance(actor.get("hybrid_engine"), dict):
        plain["actor"] = {**actor, "hybrid_engine": {**actor["hybrid_engine"], "tp_size": 1, "pp_size": 1}}
    cost = plain.get("cost")
    if isinstance(cost, dict):
        critic = cost.get("critic") or {}
        engine = {**(critic.get("engine") or {}), "tp_size": 1, "pp_size": 1}
        plain["cost"] = {**cost, "engine": {**(cost.get("engine") or {}), "tp_size": 1, "pp_size": 1},
                         "critic": {**critic, "engine": engine}}
    return plain


def _check_export_target(path: Path, target: Path, *, overwrite: bool) -> None:
    """ValueError before any model loads: an ``--out`` that is a file, or a role directory there that already holds
    files (never replaced unasked)."""
    for folder in (target, *target.parents):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {str(target)!r}: {str(folder)!r} is a file, not a directory")
    taken = [str(target / role) for role in TRAINED_ROLES
             if (path / role).is_dir() and (target / role).is_dir() and any((target / role).iterdir())]
    if taken and not overwrite:
        raise ValueError(f"--out {str(target)!r} already holds {', '.join(taken)}; allowed: another --out, or "
                         f"--overwrite to replace them")


def export_checkpoint(run_dir: str | Path, *, step: int | None = None, out: str | Path | None = None,
                      merged: bool = False, overwrite: bool = False) -> dict[str, Path]:
    """Load checkpoint ``step`` (None: the latest) of the run in ``run_dir`` into this process and export its
    trained roles to ``out`` (default ``run_dir/export/step_N``); ``merged``: LoRA roles also as merged models.
    A role directory under ``out`` that already holds files is refused unless ``overwrite``."""
    from hybridflow.controller import ResourcePool, WorkerGroup
    from hybridflow.trainers.build import COST_CRITIC_PREFIX, role_specs
    from hybridflow.trainers.checkpoint import RunCheckpointer
    from hybridflow.trainers.config.rl import RLConfig
    from hybridflow.trainers.config.loader import build_dataclass
    from hybridflow.workers import ActorWorker, CriticWorker

    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"step must be an integer (or None for the latest), got {step!r}")
    if not Path(run_dir).is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} {'is a file' if Path(run_dir).exists() else 'does not exist'}"
                         f"; give a `hybridflow train` trainer.output_dir (it holds checkpoints/)")
    checkpointer = RunCheckpointer(Path(run_dir) / "checkpoints")
    path = checkpointer.at_step(step)
    target = Path(out) if out is not None else Path(run_dir) / "export" / path.name
    _check_export_target(path, target, overwrite=overwrite)
    state = checkpointer.driver_state(path)
    if "config" not in state:
        raise ValueError(f"checkpoint {path} has no config in driver.json (written by an older hybridflow); "
                         f"export it from a run that saves its config")
    config = build_dataclass(RLConfig, _single_process_config(state["config"]))
    specs = role_specs(config)
    arguments = {"actor": (ActorWorker, (specs.actor,), {}), "critic": (CriticWorker, (specs.critic,), {}),
                 "cost_critic": (CriticWorker, (specs.cost_critic,), {"prefix": COST_CRITIC_PREFIX})}
    written = {}
    for role in TRAINED_ROLES:
        if not (path / role).is_dir():
            continue
        worker_class, args, kwargs = arguments[role]
        pool = ResourcePool([1], mode="local")  # one role at a time: only one model in memory
        group = WorkerGroup(pool, worker_class, *args, name=role, **kwargs)
        try:
            group.load_checkpoint(str(path / role))
            written.update(export_roles({role: group}, config, target, merged=merged))
        finally:
            group.shutdown()
            pool.release()
    return written


def export_main(argv: list[str]) -> int:
    """`hybridflow export RUN_DIR [--step N] [--out DIR] [--overwrite]`."""
    parser = argparse.ArgumentParser(
        prog="hybridflow export",
        description="Turn a checkpoint of a `hybridflow train` run into Hugging Face directories (one per trained "
                    "role, with tokenizer files), loadable by from_pretrained and as a model.path of the next stage.")
    parser.add_argument("run_dir", help="the run's trainer.output_dir (it holds checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export/step_N)")
    parser.add_argument("--merged", action="store_true",
                        help="LoRA runs: also write each adapted role's merged model to <role>/merged")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace role directories that already exist under the output directory")
    args = parser.parse_args(argv)
    try:
        written = export_checkpoint(args.run_dir, step=args.step, out=args.out, merged=args.merged,
                                    overwrite=args.overwrite)
    except ValueError as error:
        print(f"hybridflow export: error: {error}", file=sys.stderr)
        return 2
    for role, directory in written.items():
        print(f"{role}: {directory}")
    return 0
