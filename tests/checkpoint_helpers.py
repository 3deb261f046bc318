"""Tiny checkpoints built in the test: a random SmolLM2-shaped Llama, written as llama.cpp would."""

from pathlib import Path

import gguf
import torch
import transformers

from specjax.checkpoints import gguf as gguf_loader, hf

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_llama() -> torch.nn.Module:
    """A random SmolLM2-shaped (tied embeddings) Llama, the same on every call."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    return model


def permute(weight, num_heads: int):
    """llama.cpp's Q/K permutation (convert_hf_to_gguf), the inverse of gguf_loader.unpermute."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(
    model,
    path: Path,
    arch: str = "llama",
    skip: str | None = None,
    q8_0: str | None = None,
    skip_metadata: str | None = None,
    tokens: list[str] | None = None,
    extra_arrays: dict[str, list] | None = None,
) -> None:
    """Write a tiny HF Llama as llama.cpp would: GGUF names, Q/K permuted, F32 (or one Q8_0 tensor).

    `skip` leaves out a tensor, `skip_metadata` a `llama.*` key (e.g. "feed_forward_length"),
    `tokens` adds a `tokenizer.ggml.tokens` array, `extra_arrays` more arrays under the keys given.
    """
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    metadata = {
        "block_count": (writer.add_block_count, cfg.num_hidden_layers),
        "context_length": (writer.add_context_length, cfg.max_position_embeddings),
        "embedding_length": (writer.add_embedding_length, cfg.hidden_size),
        "feed_forward_length": (writer.add_feed_forward_length, cfg.intermediate_size),
        "head_count": (writer.add_head_count, cfg.num_attention_heads),
        "head_count_kv": (writer.add_head_count_kv, cfg.num_key_value_heads),
        "rope_freq_base": (writer.add_rope_freq_base, cfg.rope_parameters["rope_theta"]),
        "layer_norm_rms_eps": (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps),
        "vocab_size": (writer.add_vocab_size, cfg.vocab_size),
        "bos_token_id": (writer.add_bos_token_id, cfg.bos_token_id),
        "eos_token_id": (writer.add_eos_token_id, cfg.eos_token_id),
    }
    for key, (add, value) in metadata.items():
        if key != skip_metadata:
            add(value)
    if tokens is not None:
        writer.add_token_list(tokens)
    for key, values in (extra_arrays or {}).items():
        writer.add_array(key, values)
    to_gguf = {
        hf.HF_NAMES[key].format(i=i): gguf_name.format(i=i)
        for key, gguf_name in gguf_loader.GGUF_NAMES.items()
        for i in range(cfg.num_hidden_layers)
    }
    q8 = gguf.GGMLQuantizationType.Q8_0
    for hf_name, tensor in model.state_dict().items():
        gguf_name = to_gguf[hf_name]
        if gguf_name == skip or (gguf_name == "output.weight" and cfg.tie_word_embeddings):
            continue
        weight = tensor.numpy()
        if "q_proj" in hf_name:
            weight = permute(weight, cfg.num_attention_heads)
        elif "k_proj" in hf_name:
            weight = permute(weight, cfg.num_key_value_heads)
        if gguf_name == q8_0:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def word_tokenizer():
    """A whitespace word-level transformers tokenizer (vocabulary 8) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate("<unk> <s> </s> hi there hello you bye".split())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", chat_template=template
    )
