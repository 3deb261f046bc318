"""The method-agnostic training core: state, optimizer, mesh, loop, checkpoints, caches, export.

A `Method` (train.eagle3_method.Eagle3Method, train.medusa_method.MedusaMethod) supplies the params, the loss of a batch and the
target-side inputs. State (micro-step, float32 params, optimizer state) is replicated over a 1-D
("data",) mesh, batches are sharded along it and are a pure function of the micro-step, so a
resumed run replays exactly the one interrupted. Target outputs are computed in the loss
("online") or once into .npy files ("offline"). A non-finite update is never checkpointed;
broken checkpoints are skipped; derived caches are keyed by a hash of their inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import io
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from specjax.checkpoints import default_model_path, load_model
from specjax.drafters.base import BuildContext, Drafter
from specjax.drafters.registry import MethodSpec
from specjax.models import llama
from specjax.models.config import ModelConfig
from train import data, distill, sharegpt
from train.checkpoints import CheckpointError, CheckpointStore
from train.metrics_plot import plot_metrics
from train.config import SHAREGPT_KEYS, TrainConfig, load_config, parse_overrides

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class NonFiniteError(FloatingPointError):
    """A training quantity (loss, gradient norm, statistic) is NaN or infinite."""


class Method(Protocol):
    """What a training method supplies to the core (train.eagle3_method.Eagle3Method is one)."""

    name: str  # progress-bar label
    loss: Callable  # hashable, static under jit: (params, frozen, batch) -> (loss [], stats {name: [K]} sums)
    identity: str  # fingerprint of what checkpoints and offline outputs depend on beside target and rows
    def frozen(self, offline: bool) -> Any: ...  # arrays the loss reads beside params and batch
    def init_params(self, key: jax.Array) -> Any: ...  # float32 params to start from
    def target_outputs(self, tokens: np.ndarray) -> dict: ...  # what offline batches carry, for [B, T] tokens (storage dtypes)
    def summarize(self, stats: dict) -> dict: ...  # record fields from stats summed over micro-steps or batches
    def tau_evaluator(self, eval_rows: data.TokenRows) -> Callable: ...  # params -> engine tau on held-out prompts
    def export(self, params: Any, path: Path, *, overwrite: bool, evaluation: dict) -> None: ...  # the draft in its inference format


@dataclasses.dataclass(frozen=True)
class Target:
    path: Path  # HF directory or .gguf
    config: ModelConfig
    params: llama.Params  # in the target dtype (config.target_compute_dtype)


@struct.dataclass
class TrainState:
    micro_step: jax.Array  # [] int32, micro-batches consumed
    params: Any  # float32 master weights
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything fixed for a run."""

    config: TrainConfig
    method: Method
    train_rows: data.TokenRows
    eval_rows: data.TokenRows
    offline: dict[str, np.ndarray] | None  # name -> [N, ...] memory-mapped target outputs, train then eval rows
    mesh: Mesh

    @property
    def frozen(self) -> Any:
        return self.method.frozen(self.offline is not None)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clipped AdamW with linear warmup and cosine decay, accumulated over grad_accum_steps."""
    lr = config.learning_rate
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, config.warmup_steps, max(config.num_steps, config.warmup_steps + 1), lr * config.final_lr_ratio
    )
    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay)
    inner = optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
    return optax.MultiSteps(inner, every_k_schedule=config.grad_accum_steps)


def make_mesh(data_parallel: int) -> Mesh:
    devices = jax.devices()
    count = data_parallel or len(devices)
    if count > len(devices):
        raise ValueError(f"data_parallel={count} but only {len(devices)} devices")
    return Mesh(np.asarray(devices[:count]), ("data",))


@functools.partial(jax.jit, static_argnames=("loss", "optimizer"))
def train_step(state: TrainState, frozen, batch, *, loss, optimizer: TrainConfig):
    """One micro-step: loss, gradients, (accumulated) AdamW update. Returns (state, stats + total, grad_norm)."""
    (total, stats), grads = jax.value_and_grad(loss, has_aux=True)(state.params, frozen, batch)
    updates, opt_state = make_optimizer(optimizer).update(grads, state.opt_state, state.params)
    stats = {**stats, "total": total, "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.micro_step + 1, optax.apply_updates(state.params, updates), opt_state), stats


@functools.partial(jax.jit, static_argnames=("loss",))
def eval_step(params, frozen, batch, *, loss):
    return loss(params, frozen, batch)[1]


_OPTIMIZER_FIELDS = (
    "grad_accum_steps", "num_steps", "learning_rate", "warmup_steps", "final_lr_ratio", "weight_decay", "b1", "b2", "grad_clip",
)


def step_kwargs(setup: Setup) -> dict:
    """Static arguments of train_step: only what it reads, so runs share compilations."""
    optimizer = TrainConfig(**{name: getattr(setup.config, name) for name in _OPTIMIZER_FIELDS})
    return {"loss": setup.method.loss, "optimizer": optimizer}


def init_state(setup: Setup) -> TrainState:
    params = setup.method.init_params(jax.random.key(setup.config.seed))
    state = TrainState(jnp.int32(0), params, make_optimizer(setup.config).init(params))
    return jax.device_put(state, NamedSharding(setup.mesh, P()))


def get_batch(setup: Setup, rows: data.TokenRows, indices: np.ndarray, offset: int = 0) -> dict[str, jax.Array]:
    """A batch sharded on the mesh's data axis; `offset` locates the rows in the offline arrays."""
    batch = {"tokens": rows.tokens[indices], "loss_mask": rows.loss_mask[indices]}
    for name, array in (setup.offline or {}).items():
        batch[name] = np.asarray(array[indices + offset])
    return jax.device_put(batch, NamedSharding(setup.mesh, P("data")))


def evaluate(setup: Setup, params) -> dict[str, Any]:
    """Statistics summed over the held-out rows (full batches), summarized by the method."""
    rows, batch_size = setup.eval_rows, setup.config.batch_size
    totals = None
    for first in range(0, len(rows) - batch_size + 1, batch_size):
        batch = get_batch(setup, rows, np.arange(first, first + batch_size), offset=len(setup.train_rows))
        stats = jax.device_get(eval_step(params, setup.frozen, batch, loss=setup.method.loss))
        totals = stats if totals is None else jax.tree.map(np.add, totals, stats)
    return {} if totals is None else setup.method.summarize(totals)


def checkpoint_store(config: TrainConfig) -> CheckpointStore:
    return CheckpointStore(Path(config.output_dir) / "checkpoints", keep=config.keep_checkpoints)


def restore_or_init(setup: Setup, store: CheckpointStore) -> TrainState:
    """The newest intact checkpoint (digest, names, shapes and dtypes right; finite), else a fresh state.

    Broken checkpoints newer than it are moved to output_dir/corrupt_checkpoints with a warning
    naming each; if there are checkpoints but none is intact, the error names them all.
    """
    state = init_state(setup)
    broken = {}
    for step in reversed(store.steps()):
        try:
            restored = store.restore(step, state)
            bad = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(restored) if not np.isfinite(leaf).all()]
            if bad:
                raise NonFiniteError(f"non-finite values in {', '.join(bad)}")
        except (CheckpointError, NonFiniteError) as error:
            broken[step] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            continue
        for bad_step, reason in broken.items():
            aside = store.set_aside(bad_step)
            warnings.warn(f"checkpoint {store.directory / str(bad_step)} is broken ({reason}); moved to {aside}, resuming from step {step}")
        return jax.device_put(restored, NamedSharding(setup.mesh, P()))
    if broken:
        reasons = "; ".join(f"step {step}: {reason}" for step, reason in broken.items())
        raise RuntimeError(f"no intact checkpoint in {store.directory} ({reasons}); move them away to start over")
    return state


def _keep_metrics_through(path: Path, update: int) -> None:
    """Drop records past `update` (logged after the last checkpoint by a run that then stopped)."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["update"] <= update]
    if kept != lines:
        _write_atomically(path, "".join(kept).encode())


def _write_atomically(path: Path, content: bytes) -> None:
    path.with_name(path.name + ".partial").write_bytes(content)
    os.replace(path.with_name(path.name + ".partial"), path)


def train(setup: Setup, *, stop_at: int | None = None, evaluate_tau: Callable | None = None) -> tuple[TrainState, list[dict]]:
    """Run (or resume) training to num_steps updates, or to `stop_at` updates if given.

    Returns the final state and a record per update of this invocation ({"update", "total",
    "grad_norm", the method's statistics, "tokens_per_s" when logged, "eval" / "engine" when
    evaluated}); logged and evaluated ones go to output_dir/metrics.jsonl, once across resumes,
    and are plotted in output_dir/metrics.png (loss, held-out acc_k, engine tau) at every evaluation.
    Raises NonFiniteError naming the update and quantities before checkpointing a non-finite one.
    """
    config, accum = setup.config, setup.config.grad_accum_steps
    last_update = min(stop_at or config.num_steps, config.num_steps)
    if config.tau_eval_every and evaluate_tau is None:
        evaluate_tau = setup.method.tau_evaluator(setup.eval_rows)
    store = checkpoint_store(config)
    state = restore_or_init(setup, store)
    first_micro, metrics_file = int(state.micro_step), Path(config.output_dir) / "metrics.jsonl"
    _keep_metrics_through(metrics_file, first_micro // accum)
    records, window, postfix = [], None, {}
    last_log_time, last_log_micro = time.time(), first_micro
    progress = tqdm(total=last_update * accum, initial=first_micro, unit="batch", dynamic_ncols=True, desc=setup.method.name)
    for micro in range(first_micro, last_update * accum):
        indices = data.batch_indices(len(setup.train_rows), config.batch_size, micro, config.seed)
        state, stats = train_step(state, setup.frozen, get_batch(setup, setup.train_rows, indices), **step_kwargs(setup))
        stats = jax.device_get(stats)
        bad = [name for name, value in stats.items() if not np.isfinite(value).all()]
        if bad:
            progress.close()
            raise NonFiniteError(
                f"update {micro // accum + 1} (micro-step {micro + 1}): non-finite "
                f"{'loss' if 'total' in bad else 'gradient'} ({', '.join(bad)}); stopped before saving it, "
                f"the last good checkpoint is update {store.latest_step() or 'none'} in {store.directory}"
            )
        window = stats if window is None else jax.tree.map(np.add, window, stats)
        update, partial_update = divmod(micro + 1, accum)
        progress.update(1)
        if partial_update:
            continue
        record = {"update": update, "total": float(window["total"]) / accum}
        record |= {"grad_norm": round(float(window["grad_norm"]) / accum, 5), **setup.method.summarize(window)}
        window = None
        logged = update % config.log_every == 0 or update == last_update
        if logged:
            now = time.time()
            tokens = config.batch_size * config.seq_len * (micro + 1 - last_log_micro)
            record["tokens_per_s"] = round(tokens / max(now - last_log_time, 1e-9), 1)
            last_log_time, last_log_micro = now, micro + 1
            postfix["loss"] = f"{record['total']:.3f}"
            if "acc" in record:  # per-position accuracies of a multi-token draft
                postfix["acc_0"] = f"{record['acc'][0]:.3f}"
            postfix["tok_s"] = f"{record['tokens_per_s']:.0f}"
        eval_start = time.time()
        if config.eval_every and update % config.eval_every == 0:
            record["eval"] = evaluate(setup, state.params)
        if config.tau_eval_every and (update % config.tau_eval_every == 0 or update == config.num_steps):
            record["engine"] = evaluate_tau(state.params)
            postfix["tau"] = f"{record['engine']['tau']:.2f}"
        last_log_time += time.time() - eval_start  # evaluations do not count against training throughput
        records.append(record)
        if logged or "eval" in record or "engine" in record:
            with metrics_file.open("a") as file:
                file.write(json.dumps(record) + "\n")
        if "eval" in record or "engine" in record or update == last_update:
            plot_start = time.time()
            plot_metrics(config.output_dir)  # output_dir/metrics.png, current at every evaluation
            last_log_time += time.time() - plot_start
        progress.set_postfix(postfix, refresh=False)
        if update % config.checkpoint_every == 0 or update == last_update:
            store.save(update, state)
    progress.close()
    return state, records


def export(setup: Setup, params, evaluation: dict | None = None) -> Path:
    """Write the draft to config.export_path (the method's format; never a non-finite draft);
    `evaluation` is the held-out summary, which a format may record."""
    setup.method.export(jax.device_get(params), setup.config.export_path, overwrite=setup.config.overwrite, evaluation=evaluation or {})
    return setup.config.export_path


def fingerprint(*parts: Any) -> str:
    """A short hash of arrays (by content), paths (name, size, mtime of each file; a directory's files) and reprs."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            digest.update(f"{part.dtype}{part.shape}".encode() + np.ascontiguousarray(part).tobytes())
        elif isinstance(part, Path):
            if not part.exists():
                raise FileNotFoundError(f"{part} does not exist")
            files = sorted(part.iterdir()) if part.is_dir() else [part]
            digest.update(repr([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
        else:
            digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cached_arrays(path: Path, key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays stored at path (.npz) under `key`, else build() (which raises rather than return empty), stored."""
    if path.exists():
        with np.load(path) as stored:
            if "key" in stored.files and str(stored["key"]) == key:
                return {name: stored[name] for name in stored.files if name != "key"}
    arrays, buffer = build(), io.BytesIO()
    np.savez(buffer, key=np.asarray(key), **arrays)
    _write_atomically(path, buffer.getvalue())
    return arrays


def frequent_response_tokens(config: TrainConfig, target_vocab_size: int, train_rows: data.TokenRows) -> np.ndarray:
    """[Vd] sorted target ids: the config.draft_vocab_size most frequent response tokens of the
    training rows (a draft vocabulary), cached in output_dir/draft_vocab.npz under a key of its inputs."""
    if config.draft_vocab_size > target_vocab_size:
        raise ValueError(f"draft_vocab_size {config.draft_vocab_size} exceeds the target vocabulary ({target_vocab_size})")
    key = fingerprint(train_rows.tokens, train_rows.loss_mask, config.draft_vocab_size, target_vocab_size)
    build = lambda: {"ids": data.draft_vocab_ids(train_rows, config.draft_vocab_size, target_vocab_size)}
    return cached_arrays(Path(config.output_dir) / "draft_vocab.npz", key, build)["ids"]


def offline_features(method: Method, rows: data.TokenRows, directory: Path, batch_size: int, key: str) -> dict[str, np.ndarray]:
    """The method's target outputs for every row, memory-mapped from directory/<name>.npy; computed
    first unless stored under `key` (written last: an interrupted computation is redone)."""
    key_file = directory / "key"
    if not (key_file.exists() and key_file.read_text() == key):
        directory.mkdir(parents=True, exist_ok=True)
        for stale in [key_file, *directory.glob("*.npy")]:
            stale.unlink(missing_ok=True)
        arrays = {}
        for first in tqdm(range(0, len(rows), batch_size), desc="target features", unit="batch"):
            chunk = rows.tokens[first : first + batch_size]
            padded = np.zeros((batch_size, chunk.shape[1]), np.int32)  # one compilation
            padded[: len(chunk)] = chunk
            for name, output in method.target_outputs(padded).items():
                if name not in arrays:
                    path = directory / f"{name}.npy.partial"
                    arrays[name] = np.lib.format.open_memmap(path, "w+", output.dtype, (len(rows), *output.shape[1:]))
                arrays[name][first : first + len(chunk)] = output[: len(chunk)]
        for name, array in arrays.items():
            array.flush()
            os.replace(directory / f"{name}.npy.partial", directory / f"{name}.npy")
        key_file.write_text(key)
    return {path.stem: np.load(path, mmap_mode="r") for path in sorted(directory.glob("*.npy"))}


def load_sharegpt(config: TrainConfig, tokenizer) -> sharegpt.Loaded:
    """The ShareGPT data `config.data` cleaned and split as the config says (train.sharegpt), tokens
    counted with the target's tokenizer; conversations containing an MT-bench question are dropped."""
    return sharegpt.load(
        sharegpt.source_path(config.data), max_turns=config.max_turns, max_tokens=config.max_conversation_tokens,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]),
        held_out_permille=config.held_out_permille, max_records=config.max_conversations,
        benchmark_prompts=sharegpt.mt_bench_questions(),
    )


def sharegpt_conversations(config: TrainConfig, tokenizer) -> list[list[dict[str, str]]]:
    """The training split of the ShareGPT data `config.data` (train.sharegpt), none containing an MT-bench
    question; its report is printed and written to output_dir/data_report.json."""
    loaded = load_sharegpt(config, tokenizer)
    print(loaded.report.summary(), file=sys.stderr)
    (Path(config.output_dir) / "data_report.json").write_text(loaded.report.to_json())
    if not loaded.train:
        raise ValueError(f"no conversation of {config.data} is left to train on:\n{loaded.report.summary()}")
    return loaded.train


def distill_drafter(config: TrainConfig, target: Target) -> Drafter | None:
    """The drafter of `distill_method` on the target (None: plain decoding)."""
    spec = MethodSpec.parse(config.distill_method)
    if spec.method == "ar":
        return None
    return spec.build(BuildContext(target.config, target.params, None, DTYPES[config.target_compute_dtype]))


#: How token_rows orders conversations, part of its cache key (rows cached under an older order are rebuilt).
ROW_ORDER = "distilled in source order, shuffled after"


def token_rows(config: TrainConfig, target: Target) -> data.TokenRows:
    """The data as token rows (self-distilled if asked), cached in output_dir/rows.npz under a key of their inputs."""
    tokenizer_path = Path(config.tokenizer) if config.tokenizer else target.path
    distill_settings = ("distill_max_new_tokens", "distill_batch_size", "distill_temperature", "target_compute_dtype")
    distilled_by = (target.path, *(getattr(config, name) for name in distill_settings)) if config.self_distill else ()
    settings = (config.seq_len, config.pack, config.max_samples, config.seed, config.self_distill, distilled_by, ROW_ORDER)
    if config.data:  # the file and how it is cleaned (train.sharegpt)
        cleaning = (*(getattr(config, name) for name in SHAREGPT_KEYS), sharegpt.mt_bench_questions())
        sources = (sharegpt.source_path(config.data), *cleaning)
    else:
        sources = tuple(map(Path, config.data_files))
    key = fingerprint(*sources, tokenizer_path, *settings)

    def build() -> dict[str, np.ndarray]:
        tokenizer = data.load_tokenizer(str(tokenizer_path))
        if config.data:
            conversations = sharegpt_conversations(config, tokenizer)
        else:
            conversations = data.load_conversations(config.data_files)
        if config.max_samples:  # a random subset, in source order
            subset = np.random.default_rng(config.seed).permutation(len(conversations))[: config.max_samples]
            conversations = [conversations[i] for i in np.sort(subset)]
        if config.self_distill:  # every assistant turn regenerated by the target, kept in output_dir
            # In source order: a run over more of the source (max_conversations) appends to what a
            # smaller one distilled, and a smaller run uses its first records.
            path = Path(config.output_dir) / "distilled.jsonl"
            distilled = distill.regenerate_to_file(
                path, [{"conversations": messages} for messages in conversations], target.config, target.params,
                tokenizer, batch_size=config.distill_batch_size, max_prompt_tokens=config.seq_len,
                max_new_tokens=config.distill_max_new_tokens, temperature=config.distill_temperature, seed=config.seed,
                archive=Path(config.distilled_archive) if config.distilled_archive else None,
                drafter=distill_drafter(config, target),
            )
            conversations = distill.load_regenerated(path, distilled)
        order = np.random.default_rng(config.seed).permutation(len(conversations))
        conversations = [conversations[i] for i in order]
        rows = data.to_rows([data.tokenize_conversation(tokenizer, c) for c in conversations], config.seq_len, config.pack)
        if not len(rows):
            source = config.data or ", ".join(config.data_files)
            raise ValueError(f"no conversation of {source} has a response token within seq_len {config.seq_len}")
        return {"tokens": rows.tokens, "loss_mask": rows.loss_mask}

    return data.TokenRows(**cached_arrays(Path(config.output_dir) / "rows.npz", key, build))


def prepare(config: TrainConfig, make_method: Callable[[TrainConfig, Target, data.TokenRows], Method]) -> Setup:
    """Load the target, build (or reuse) the token rows, the method and the offline features."""
    mesh = make_mesh(config.data_parallel)
    if config.batch_size % mesh.size:
        raise ValueError(f"batch_size {config.batch_size} must be a multiple of the {mesh.size} data-parallel devices")
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    target_path = Path(config.target) if config.target else default_model_path()
    target = Target(target_path, *load_model(target_path, DTYPES[config.target_compute_dtype]))
    rows = token_rows(config, target)
    num_train = len(rows) - config.eval_samples
    if num_train < config.batch_size:
        raise ValueError(f"{len(rows)} rows less eval_samples {config.eval_samples} cannot fill a batch of {config.batch_size}")
    train_rows, eval_rows = rows.subset(slice(0, num_train)), rows.subset(slice(num_train, None))
    method = make_method(config, target, train_rows)
    checkpoints, identity_file = Path(config.output_dir) / "checkpoints", Path(config.output_dir) / "checkpoints.key"
    if identity_file.exists() and identity_file.read_text() != method.identity and any(checkpoints.glob("*")):
        raise ValueError(
            f"{checkpoints} holds checkpoints of another draft (its vocabulary or shapes changed, e.g. with the data); "
            "use a new output_dir, or move the checkpoints away to start over"
        )
    identity_file.write_text(method.identity)
    offline = None
    if config.features == "offline":
        key = fingerprint(rows.tokens, target.path, config.target_compute_dtype, method.identity)
        offline = offline_features(method, rows, config.features_path, config.batch_size, key)
    return Setup(config, method, train_rows, eval_rows, offline, mesh)


def main(argv: list[str] | None, prepare_run: Callable[[TrainConfig], Setup], description: str) -> None:
    """The command line of a method: prepare, train (resuming), evaluate on held-out rows, export."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="YAML file of TrainConfig fields")
    args, rest = parser.parse_known_args(argv)
    config = load_config(args.config, parse_overrides(rest))
    setup = prepare_run(config)
    rows, held_out, tokens = len(setup.train_rows), len(setup.eval_rows), int(setup.train_rows.loss_mask.sum())
    print(f"{rows} training rows, {held_out} held out, {tokens} response tokens; {setup.mesh.size} device(s)", file=sys.stderr)
    evaluate_tau = setup.method.tau_evaluator(setup.eval_rows) if config.tau_eval_every else None
    state, records = train(setup, evaluate_tau=evaluate_tau)
    result = evaluate(setup, state.params)
    if evaluate_tau is not None:
        result["engine"] = records[-1]["engine"] if records else evaluate_tau(state.params)
    path = export(setup, state.params, result)
    (Path(config.output_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"eval": result, "exported": str(path)}), file=sys.stderr)
