"""A run's sinks besides its JSONL files (components/metrics.py feeds them): TensorBoard, and
Weights & Biases when metrics.enable_wandb is on. Each takes scalars and text at a step."""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from titanlite.components.run.files import NO_ROOM, RunFiles
from titanlite.config.job_config import Metrics as MetricsConfig
from titanlite.errors import TrainingError, UserError, first_line
from titanlite.tools.cache import atomic_write_bytes, disk_full

logger = logging.getLogger("titanlite")


class TensorBoard:
    """A sink: TensorBoard events in <run folder>/tb, one TensorBoard run per run folder
    whatever the folder is called later (TensorBoard names a run by its folder under the log dir:
    `--logdir <dump folder>` shows each as `<run name>/tb`). `purge_step`: a resumed run drops
    the events of the steps it repeats. Its writer appends from a thread of its own; each log
    step flushes it, so a failure shows there: tb/ removed under the run is made again (with one
    line), a full disk stops the run (exit 3)."""

    def __init__(
        self,
        run_dir: Path,
        purge_step: int | None,
        files: RunFiles,
    ) -> None:
        self.run_dir, self.log_dir = run_dir, tensorboard_dir(run_dir)
        self.fail_write: Callable[[str], OSError | None] | None = None  # RunFiles' seam, for tb/
        self.files = files  # the run folder's writer: the stop lines' words of what the run leaves
        _quiet_writer_thread()
        self._writer = self._open(purge_step)

    def _open(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def _events(self) -> Path:
        return Path(self._writer._get_file_writer().event_writer._file_name)

    def _call(self, write: Callable[[Any], None]) -> None:
        try:
            error = self.fail_write("tb") if self.fail_write else None
            if error is not None:
                raise error
            if not self._events().is_file():  # tb/ or its event file removed under the run
                raise FileNotFoundError(errno.ENOENT, "removed", str(self._events()))
            write(self._writer)
            self._writer.flush()
        except Exception as e:  # noqa: BLE001 - the writer's thread re-raises whatever stopped it
            if isinstance(e, FileNotFoundError) and not self.run_dir.is_dir():
                raise TrainingError(self.files.gone()) from None  # the run folder itself, moved or removed
            if not isinstance(e, FileNotFoundError):
                room = isinstance(e, OSError) and e.errno in NO_ROOM
                raise TrainingError(
                    f"TensorBoard's writer under {self.log_dir} failed: {_cause(e, self.log_dir)}; "
                    + self.files.what_was_kept(
                        "make room" if room else "mend that, or set metrics.enable_tensorboard = false"
                    )
                ) from None
            with contextlib.suppress(Exception):  # the broken writer's own close fails the same way
                self._writer.close()
            logger.warning(
                f"{self.log_dir} was removed while the run wrote to it; writing it again from here"
            )
            self._writer = self._open()
            write(self._writer)
            self._writer.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._call(lambda w: [w.add_scalar(tag, value, step) for tag, value in values.items()])

    def text(self, tag: str, text: str, step: int) -> None:
        self._call(lambda w: w.add_text(tag, text, step))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a failure was reported where it happened
            self._writer.close()


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread keeps the error that stopped it for the next flush, where
    TensorBoard._call stops the run in one line, and raises it too, which Python prints as a
    thread's traceback: that print is dropped (threading.excepthook), for that thread only."""
    previous = threading.excepthook
    if getattr(previous, "titanlite", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        kept = getattr(args.thread, "exception", None) is args.exc_value is not None
        if not (kept and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.titanlite = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def tensorboard_dir(run_dir: Path) -> Path:
    """Where a run's TensorBoard events go (see TensorBoard)."""
    return run_dir / "tb"


def _cause(e: BaseException, folder: Path) -> str:
    return (disk_full(e, folder) if isinstance(e, OSError) else None) or first_line(e)


WANDB_ID_FILE = "wandb_id"  # in the run folder: a resumed run continues the same W&B run
WANDB_STEP = "step"  # the x axis of every W&B chart (see WandB)


def wandb_run_id(run_dir: Path) -> str:
    """The run folder's W&B run id, made on its first use and kept in the folder."""
    path = run_dir / WANDB_ID_FILE
    run_id = path.read_text().strip() if path.is_file() else ""
    if run_id:
        return run_id
    run_id = secrets.token_hex(8)
    atomic_write_bytes(path, (run_id + "\n").encode())
    return run_id


class WandB:
    """A sink: Weights & Biases (imported only when metrics.enable_wandb is on).

    Values are logged against our own `step` key (define_metric), never wandb's `step=`: W&B
    drops a value whose step is below one it has seen, yet a log step writes the diagnostics of
    earlier steps after its train record, and a resumed run repeats the steps after its checkpoint."""

    def __init__(self, run_dir: Path, metrics: MetricsConfig, config: dict[str, Any]) -> None:
        import wandb

        try:
            self._run = wandb.init(
                project=metrics.wandb_project,
                entity=metrics.wandb_entity or None,
                mode=metrics.wandb_mode,
                dir=str(run_dir),
                name=run_dir.name,
                id=wandb_run_id(run_dir),
                resume="allow",
                config=config,
            )
        except Exception as e:  # no login, no network, a bad project: wandb's own exception types
            raise UserError(
                f"metrics.enable_wandb: wandb.init failed ({first_line(e)}); run `wandb login`, "
                "set metrics.wandb_mode = 'offline' or metrics.enable_wandb = false"
            ) from None
        self._run.define_metric(WANDB_STEP)
        self._groups: set[str] = set()

    def _axis(self, tags: Iterable[str]) -> None:
        """Each group ("train", "diag", ...) or lone tag ("1_loss") gets the `step` axis on its
        first value."""
        for tag in tags:
            group, slash, _ = tag.partition("/")
            if group not in self._groups:
                self._groups.add(group)
                self._run.define_metric(f"{group}/*" if slash else group, step_metric=WANDB_STEP)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._axis(values)
        self._run.log({**values, WANDB_STEP: step})

    def text(self, tag: str, text: str, step: int) -> None:
        self._axis([tag])
        self._run.log({tag: text, WANDB_STEP: step})

    def close(self) -> None:
        self._run.finish()
