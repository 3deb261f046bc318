"""The EAGLE-3 training loop: jitted TTT step, AdamW schedule, data parallelism, checkpoints.

State is one pytree (micro-step counter, float32 draft params, optimizer state) replicated over
a 1-D ("data",) mesh; batches are sharded along it. The target is frozen: in "online" mode its
forward runs inside the jitted step, in "offline" mode its outputs come from .npy files written
once by `precompute_features`. Batches are a pure function of the micro-step, so resuming from
an orbax checkpoint replays exactly the run that was interrupted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from specjax.checkpoints import default_model_path, load_model
from specjax.checkpoints.eagle3 import load_eagle3, save_eagle3
from specjax.models import eagle3, llama
from specjax.models.config import ModelConfig
from train import data, distill, tau_eval, ttt
from train.config import TrainConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@struct.dataclass
class TrainState:
    micro_step: jax.Array  # [] int32, micro-batches consumed
    params: eagle3.Params  # float32 master weights
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything fixed for a run: models, vocabulary, data, mesh."""

    config: TrainConfig
    target_config: ModelConfig
    target_params: llama.Params  # compute dtype
    draft_config: eagle3.Eagle3Config
    vocab: eagle3.DraftVocab
    train_rows: data.TokenRows
    eval_rows: data.TokenRows
    offline: data.OfflineFeatures | None  # rows: train rows, then eval rows
    mesh: Mesh
    initial_params: eagle3.Params | None = None  # from config.init_from; None = random init

    @property
    def step_target_params(self) -> llama.Params:
        """What the jitted steps read of the target: all of it online, the embeddings offline."""
        if self.config.features == "offline":
            return {"embed_tokens": self.target_params["embed_tokens"]}
        return self.target_params


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Clipped AdamW with linear warmup and cosine decay, accumulated over grad_accum_steps."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(config.num_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.final_lr_ratio,
    )
    inner = optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay),
    )
    return optax.MultiSteps(inner, every_k_schedule=config.grad_accum_steps)


def make_mesh(data_parallel: int) -> Mesh:
    devices = jax.devices()
    count = data_parallel or len(devices)
    if count > len(devices):
        raise ValueError(f"data_parallel={count} but only {len(devices)} devices")
    return Mesh(np.asarray(devices[:count]), ("data",))


def target_outputs(
    target_params: llama.Params,
    target_config: ModelConfig,
    tokens: jax.Array,
    vocab: eagle3.DraftVocab,
) -> dict[str, jax.Array]:
    """Frozen target forward over [B, T] tokens: features, draft-vocab logits, in-vocab argmax."""
    batch, length = tokens.shape
    out = llama.forward(
        target_params,
        target_config,
        tokens,
        jnp.broadcast_to(jnp.arange(length), (batch, length)),
        None,
        jnp.tril(jnp.ones((length, length), bool)),
        taps=llama.Taps(layer_inputs=eagle3.feature_layers(target_config.num_layers)),
    )
    return {
        "features": out.features,  # [B, T, 3H]
        "target_logits": out.logits[..., vocab.target_ids],  # [B, T, Vd]
        "in_vocab": vocab.t2d[jnp.argmax(out.logits, -1)],  # [B, T]
    }


def _loss_inputs(config: TrainConfig, target_config: ModelConfig, target_params, vocab, batch):
    """Target-side inputs of the TTT loss (constants for the gradient), online or from the batch."""
    tokens = batch["tokens"]
    outputs = batch if config.features == "offline" else target_outputs(target_params, target_config, tokens, vocab)
    return {
        "embeddings": llama.embed(target_params, tokens),  # [B, T, H]
        "features": outputs["features"],
        "target_logits": outputs["target_logits"],
        "in_vocab": outputs["in_vocab"],
        "loss_mask": batch["loss_mask"],
    }


def _loss(params, draft_config, config: TrainConfig, inputs):
    dtype = _DTYPES[config.compute_dtype]
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    return ttt.ttt_loss(
        params,
        draft_config,
        inputs["embeddings"].astype(dtype),
        inputs["features"].astype(dtype),
        inputs["target_logits"],
        inputs["in_vocab"],
        inputs["loss_mask"],
        num_steps=config.ttt_length,
        decay=config.ttt_decay,
    )


@functools.partial(jax.jit, static_argnames=("config", "target_config", "draft_config"))
def train_step(state: TrainState, target_params, vocab, batch, *, config, target_config, draft_config):
    """One micro-step: TTT loss, gradients, (accumulated) AdamW update. Returns (state, stats)."""
    inputs = _loss_inputs(config, target_config, target_params, vocab, batch)
    (loss, stats), grads = jax.value_and_grad(_loss, has_aux=True)(state.params, draft_config, config, inputs)
    updates, opt_state = make_optimizer(config).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    stats = {**stats, "total": loss}
    return TrainState(micro_step=state.micro_step + 1, params=params, opt_state=opt_state), stats


@functools.partial(jax.jit, static_argnames=("config", "target_config", "draft_config"))
def eval_step(params, target_params, vocab, batch, *, config, target_config, draft_config):
    inputs = _loss_inputs(config, target_config, target_params, vocab, batch)
    return _loss(params, draft_config, config, inputs)[1]


def init_state(setup: Setup) -> TrainState:
    params = setup.initial_params
    if params is None:
        params = eagle3.init_params(setup.draft_config, jax.random.key(setup.config.seed))
    state = TrainState(jnp.int32(0), params, make_optimizer(setup.config).init(params))
    return jax.device_put(state, NamedSharding(setup.mesh, P()))


def get_batch(setup: Setup, rows: data.TokenRows, indices: np.ndarray, offset: int = 0) -> dict[str, jax.Array]:
    """A batch sharded on the mesh's data axis; `offset` locates the rows in the offline arrays."""
    batch = {"tokens": rows.tokens[indices], "loss_mask": rows.loss_mask[indices]}
    if setup.offline is not None:
        batch |= setup.offline.batch(indices + offset)
    return jax.device_put(batch, NamedSharding(setup.mesh, P("data")))


_STEP_FIELDS = (
    "features", "ttt_length", "ttt_decay", "compute_dtype", "grad_accum_steps", "num_steps", "learning_rate",
    "warmup_steps", "final_lr_ratio", "weight_decay", "b1", "b2", "grad_clip",
)


def step_kwargs(setup: Setup) -> dict:
    """Static arguments of the jitted steps: only the fields they read, so runs share compilations."""
    step_config = TrainConfig(**{name: getattr(setup.config, name) for name in _STEP_FIELDS})
    return {"config": step_config, "target_config": setup.target_config, "draft_config": setup.draft_config}


def summarize(stats: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per-step loss_k and acc_k and the simulated acceptance length from summed stats [K]."""
    loss = stats["loss_sum"] / np.maximum(stats["weight"], 1)
    acc = stats["correct"] / np.maximum(stats["response"], 1)
    return {
        "loss": [round(float(x), 5) for x in loss],
        "acc": [round(float(x), 5) for x in acc],
        "acceptance_length": round(float(ttt.acceptance_length(jnp.asarray(acc))), 4),
    }


def evaluate(setup: Setup, params: eagle3.Params) -> dict[str, Any]:
    """Summed TTT statistics over the held-out rows (full batches), summarized."""
    rows, batch_size = setup.eval_rows, setup.config.batch_size
    totals = None
    for first in range(0, len(rows) - batch_size + 1, batch_size):
        indices = np.arange(first, first + batch_size)
        batch = get_batch(setup, rows, indices, offset=len(setup.train_rows))
        stats = jax.device_get(eval_step(params, setup.step_target_params, setup.vocab, batch, **step_kwargs(setup)))
        totals = stats if totals is None else jax.tree.map(np.add, totals, stats)
    return {} if totals is None else summarize(totals)


def tau_evaluator(setup: Setup) -> tau_eval.TauEvaluator:
    """The engine evaluation on the first tau_eval_prompts held-out rows (compiled once)."""
    config = setup.config
    return tau_eval.TauEvaluator(
        setup.draft_config,
        setup.vocab,
        setup.target_config,
        setup.target_params,
        tau_eval.held_out_prompts(setup.eval_rows, config.tau_eval_prompts),
        num_spec=config.tau_eval_num_spec,
        max_new_tokens=config.tau_eval_max_new_tokens,
    )


def checkpoint_manager(config: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    return ocp.CheckpointManager(Path(config.output_dir).resolve() / "checkpoints", options=options)


def restore_or_init(setup: Setup, manager: ocp.CheckpointManager) -> TrainState:
    """The latest checkpoint if there is one, else a fresh state."""
    state = init_state(setup)
    latest = manager.latest_step()
    if latest is None:
        return state
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    return manager.restore(latest, args=ocp.args.StandardRestore(abstract))


def train(
    setup: Setup, *, stop_at: int | None = None, evaluate_tau: tau_eval.TauEvaluator | None = None
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Run (or resume) training to num_steps updates, or to `stop_at` updates if given.

    Returns the final state and one record per update of this invocation ({"update", "total",
    "loss", "acc", ...}, with "tokens_per_s" when logged, and "eval" (held-out TTT statistics)
    or "engine" (held-out tau from the engine) when evaluated); logged and evaluated records are
    also appended to output_dir/metrics.jsonl. evaluate_tau defaults to `tau_evaluator(setup)`.
    """
    config = setup.config
    manager = checkpoint_manager(config)
    state = restore_or_init(setup, manager)
    accum = config.grad_accum_steps
    last_update = min(stop_at or config.num_steps, config.num_steps)
    first_micro = int(state.micro_step)
    metrics_file = Path(config.output_dir) / "metrics.jsonl"
    if config.tau_eval_every and evaluate_tau is None:
        evaluate_tau = tau_evaluator(setup)
    records, window, postfix = [], None, {}
    last_log_time, last_log_micro = time.time(), first_micro
    tokens_per_micro = config.batch_size * config.seq_len
    progress = tqdm(
        total=last_update * accum, initial=first_micro, unit="batch", dynamic_ncols=True, desc="eagle3"
    )
    for micro in range(first_micro, last_update * accum):
        indices = data.batch_indices(len(setup.train_rows), config.batch_size, micro, config.seed)
        state, stats = train_step(
            state, setup.step_target_params, setup.vocab, get_batch(setup, setup.train_rows, indices), **step_kwargs(setup)
        )
        stats = jax.device_get(stats)
        window = stats if window is None else jax.tree.map(np.add, window, stats)
        update, partial_update = divmod(micro + 1, accum)
        progress.update(1)
        if partial_update:
            continue
        record = {"update": update, "total": float(window["total"]) / accum, **summarize(window)}
        window = None
        logged = update % config.log_every == 0 or update == last_update
        if logged:
            now = time.time()
            record["tokens_per_s"] = round(tokens_per_micro * (micro + 1 - last_log_micro) / max(now - last_log_time, 1e-9), 1)
            last_log_time, last_log_micro = now, micro + 1
            postfix |= {"loss": f"{record['total']:.3f}", "acc_0": f"{record['acc'][0]:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
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
        progress.set_postfix(postfix, refresh=False)
        if update % config.checkpoint_every == 0 or update == last_update:
            manager.save(update, args=ocp.args.StandardSave(state))
    progress.close()
    manager.wait_until_finished()
    return state, records


def export(setup: Setup, params: eagle3.Params) -> Path:
    """Write the draft in the EAGLE-3 Hugging Face layout to config.export_path."""
    dtype = ml_dtypes.bfloat16 if setup.config.export_dtype == "bfloat16" else np.dtype(setup.config.export_dtype)
    save_eagle3(setup.config.export_path, setup.draft_config, jax.device_get(params), setup.vocab, dtype=dtype)
    return setup.config.export_path


def precompute_features(
    target_params, target_config: ModelConfig, vocab: eagle3.DraftVocab, rows: data.TokenRows, directory: Path, batch_size: int
) -> None:
    """Write the target's outputs for every row as .npy files (float16 features and logits)."""
    directory.mkdir(parents=True, exist_ok=True)
    forward = jax.jit(functools.partial(target_outputs, target_config=target_config))
    num_rows, length = rows.tokens.shape
    shapes = {
        "features": ((num_rows, length, 3 * target_config.hidden_size), np.float16),
        "target_logits": ((num_rows, length, vocab.d2t.shape[0]), np.float16),
        "in_vocab": ((num_rows, length), np.bool_),
    }
    arrays = {
        name: np.lib.format.open_memmap(directory / f"{name}.npy.partial", "w+", dtype, shape)
        for name, (shape, dtype) in shapes.items()
    }
    for first in tqdm(range(0, num_rows, batch_size), desc="target features", unit="batch"):
        chunk = rows.tokens[first : first + batch_size]
        padded = np.zeros((batch_size, length), np.int32)
        padded[: len(chunk)] = chunk
        outputs = jax.device_get(forward(target_params, tokens=jnp.asarray(padded), vocab=vocab))
        for name, array in arrays.items():
            array[first : first + len(chunk)] = outputs[name][: len(chunk)]
    for name, array in arrays.items():
        array.flush()
        (directory / f"{name}.npy.partial").rename(directory / f"{name}.npy")


def load_initial_draft(
    path: str, draft_config: eagle3.Eagle3Config, target_config: ModelConfig, *, any_vocab_size: bool = False
) -> tuple[eagle3.Params, eagle3.DraftVocab]:
    """Float32 params and vocabulary of an EAGLE-3 draft to continue training; it must fit this run.

    any_vocab_size: accept a different draft_vocab_size (the head is then remapped, see remap_draft_head).
    """
    config, params, vocab = load_eagle3(path, target_vocab_size=target_config.vocab_size)
    if any_vocab_size:
        config = dataclasses.replace(config, draft_vocab_size=draft_config.draft_vocab_size)
    if config != draft_config:
        differences = {
            field.name: (getattr(config, field.name), getattr(draft_config, field.name))
            for field in dataclasses.fields(config)
            if getattr(config, field.name) != getattr(draft_config, field.name)
        }
        raise ValueError(f"init_from {path}: the draft differs from this run's (draft, run): {differences}")
    return params, vocab


def remap_draft_head(
    params: eagle3.Params, old_ids: np.ndarray, new_ids: np.ndarray, target_params: llama.Params, target_config: ModelConfig
) -> eagle3.Params:
    """The draft moved to a new vocabulary (sorted target ids old_ids [Vo] -> new_ids [Vn]).

    Tokens in both keep their trained lm_head column. A new token starts from the target's output
    embedding of it, scaled by the median norm ratio of trained to target columns over the shared tokens.
    """
    head = np.asarray(params["lm_head"], np.float32)  # [H, Vo]
    if target_config.tie_word_embeddings:
        target_head = np.asarray(target_params["embed_tokens"], np.float32).T  # [H, V]
    else:
        target_head = np.asarray(target_params["lm_head"], np.float32)  # [H, V]
    shared, old_index, new_index = np.intersect1d(old_ids, new_ids, return_indices=True)
    if len(shared) == 0:
        raise ValueError("the new draft vocabulary shares no token with init_from's: nothing to carry over")
    target_norms = np.linalg.norm(target_head[:, shared], axis=0)  # [S]
    trained_norms = np.linalg.norm(head[:, old_index], axis=0)  # [S]
    scale = np.median(trained_norms[target_norms > 0] / target_norms[target_norms > 0])
    new_head = scale * target_head[:, new_ids]  # [H, Vn]
    new_head[:, new_index] = head[:, old_index]
    return {**params, "lm_head": jnp.asarray(new_head)}


def self_distill(config: TrainConfig, target_config, target_params, tokenizer, conversations):
    """The conversations with every assistant turn regenerated by the target (kept in output_dir)."""
    path = Path(config.output_dir) / "distilled.jsonl"
    distill.regenerate_to_file(
        path,
        [{"conversations": c} for c in conversations],
        target_config,
        target_params,
        tokenizer,
        batch_size=config.distill_batch_size,
        max_prompt_tokens=config.seq_len,
        max_new_tokens=config.distill_max_new_tokens,
        temperature=config.distill_temperature,
        seed=config.seed,
    )
    return distill.load_regenerated(path)


def prepare(config: TrainConfig) -> Setup:
    """Load the target, tokenize the data, fix the draft vocabulary and the features."""
    mesh = make_mesh(config.data_parallel)
    if config.batch_size % mesh.size:
        raise ValueError(f"batch_size {config.batch_size} must be a multiple of the {mesh.size} data-parallel devices")
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target_path = config.target or str(default_model_path())
    dtype = _DTYPES[config.compute_dtype]
    target_config, target_params = load_model(target_path, dtype)

    rows_file = output_dir / "rows.npz"
    if rows_file.exists():
        stored = np.load(rows_file)
        rows = data.TokenRows(stored["tokens"], stored["loss_mask"])
    else:
        tokenizer = data.load_tokenizer(config.tokenizer or target_path)
        conversations = data.load_conversations(config.data_files)
        order = np.random.default_rng(config.seed).permutation(len(conversations))
        if config.max_samples:
            order = order[: config.max_samples]
        conversations = [conversations[i] for i in order]
        if config.self_distill:
            conversations = self_distill(config, target_config, target_params, tokenizer, conversations)
        rows = data.to_rows([data.tokenize_conversation(tokenizer, c) for c in conversations], config.seq_len, config.pack)
        np.savez(rows_file, tokens=rows.tokens, loss_mask=rows.loss_mask)
    num_train = len(rows) - config.eval_samples
    train_rows, eval_rows = rows.subset(slice(0, num_train)), rows.subset(slice(num_train, None))

    draft_config = eagle3.Eagle3Config.from_target(target_config, config.draft_vocab_size)
    vocab_file = output_dir / "draft_vocab.npy"
    initial_params = None
    rebuild = config.init_vocab == "rebuild" or not config.init_from
    if rebuild and not vocab_file.exists():
        np.save(vocab_file, data.draft_vocab_ids(train_rows, config.draft_vocab_size, target_config.vocab_size))
    if config.init_from:
        initial_params, initial_vocab = load_initial_draft(
            config.init_from, draft_config, target_config, any_vocab_size=rebuild
        )
        initial_ids = np.asarray(initial_vocab.target_ids)
        if rebuild:
            initial_params = remap_draft_head(initial_params, initial_ids, np.load(vocab_file), target_params, target_config)
        else:
            np.save(vocab_file, initial_ids)
    vocab = eagle3.DraftVocab.from_target_ids(jnp.asarray(np.load(vocab_file)), target_config.vocab_size)

    offline = None
    if config.features == "offline":
        if not data.OfflineFeatures.exists(config.features_path):
            precompute_features(target_params, target_config, vocab, rows, config.features_path, config.batch_size)
        offline = data.OfflineFeatures.open(config.features_path, len(rows))
    return Setup(
        config=config,
        target_config=target_config,
        target_params=target_params,
        draft_config=draft_config,
        vocab=vocab,
        train_rows=train_rows,
        eval_rows=eval_rows,
        offline=offline,
        mesh=mesh,
        initial_params=initial_params,
    )
