"""Tiny vision-language models from configs (no hub) and images laid out as each family's processor
lays them out: what the VLM tests, benches and examples run.

:func:`tiny_vlm` builds a family's ``...ForConditionalGeneration`` with a few-layer vision tower;
:func:`tiny_image` returns one image's placeholder tokens (as the processor expands them, with the
family's start/end tokens) and its model keywords, for a prompt's
:class:`~grpo_parts.types.VisionInputs` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .compat import transformers_version

#: token ids the tiny configs reserve at the top of the vocabulary (``vocab_size`` >= 16)
IMAGE, VIDEO, START, END = -4, -3, -2, -1


def _qwen_text(vocab: int, hidden: int, heads: int, kv: int, layers: int) -> dict[str, Any]:
    half = hidden // heads // 2  # M-RoPE splits the rotary half of a head into (t, h, w) sections
    section = [half - 2 * (half // 3), half // 3, half // 3]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if transformers_version() < (5, 0):  # 4.x: rope_scaling, its type "mrope"
        rope = {"rope_scaling": {"type": "mrope", "mrope_section": section}, "rope_theta": 10000.0}
    else:
        rope = {"rope_parameters": rope}
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192, **rope,
    )  # fmt: skip


def _qwen_tokens(vocab: int) -> dict[str, Any]:
    return dict(
        image_token_id=vocab + IMAGE, video_token_id=vocab + VIDEO,
        vision_start_token_id=vocab + START, vision_end_token_id=vocab + END,
    )  # fmt: skip


def _qwen2_vl(cls: Any, vocab: int, hidden: int, heads: int, kv: int, layers: int, vl: int, vh: int) -> Any:
    vision = dict(depth=vl, embed_dim=vh, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=1, in_channels=3)  # fmt: skip
    text = _qwen_text(vocab, hidden, heads, kv, layers)
    return cls(text_config=text, vision_config=vision, **_qwen_tokens(vocab))


def _qwen2_5_vl(cls: Any, vocab: int, hidden: int, heads: int, kv: int, layers: int, vl: int, vh: int) -> Any:
    vision = dict(depth=vl + 1, hidden_size=vh, intermediate_size=2 * vh, num_heads=2, out_hidden_size=hidden,
                  patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3, window_size=8,
                  fullatt_block_indexes=[vl])  # fmt: skip
    text = _qwen_text(vocab, hidden, heads, kv, layers)
    return cls(text_config=text, vision_config=vision, **_qwen_tokens(vocab))


def _qwen3_vl(cls: Any, vocab: int, hidden: int, heads: int, kv: int, layers: int, vl: int, vh: int) -> Any:
    text = _qwen_text(vocab, hidden, heads, kv, layers)
    text["head_dim"] = hidden // heads
    (text.get("rope_parameters") or text["rope_scaling"])["mrope_interleaved"] = True
    vision = dict(depth=vl + 1, hidden_size=vh, intermediate_size=2 * vh, num_heads=2, out_hidden_size=hidden,
                  patch_size=2, spatial_merge_size=2, temporal_patch_size=1, in_channels=3,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])  # fmt: skip
    return cls(text_config=text, vision_config=vision, **_qwen_tokens(vocab))


def _llava(cls: Any, vocab: int, hidden: int, heads: int, kv: int, layers: int, vl: int, vh: int) -> Any:
    text = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv)  # fmt: skip
    vision = dict(model_type="clip_vision_model", hidden_size=vh, intermediate_size=2 * vh, num_hidden_layers=vl,
                  num_attention_heads=2, image_size=8, patch_size=4)  # fmt: skip
    # image_token_id (image_token_index before 5.x renamed it; the config maps the old name)
    image: dict[str, Any] = {"image_token_id": vocab + IMAGE}
    return cls(text_config=text, vision_config=vision, projector_hidden_act="gelu", vision_feature_layer=-1,
               **image)  # fmt: skip


def _gemma3(cls: Any, vocab: int, hidden: int, heads: int, kv: int, layers: int, vl: int, vh: int) -> Any:
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads)  # fmt: skip
    vision = dict(hidden_size=vh, intermediate_size=2 * vh, num_hidden_layers=vl, num_attention_heads=2,
                  image_size=8, patch_size=2)  # fmt: skip
    image: dict[str, Any] = {"image_token_id": vocab + IMAGE}
    return cls(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab + START,
               eoi_token_index=vocab + END, **image)  # fmt: skip


#: family -> (its transformers config class, absent from older releases: Qwen3-VL before 4.57; the builder
#: ``(that class, vocab, hidden, heads, kv_heads, layers, vision_layers, vision_hidden) -> config``)
VLM_FAMILIES: dict[str, tuple[str, Callable[..., Any]]] = {
    "qwen2_vl": ("Qwen2VLConfig", _qwen2_vl),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", _qwen2_5_vl),
    "qwen3_vl": ("Qwen3VLConfig", _qwen3_vl),
    "llava": ("LlavaConfig", _llava),
    "gemma3": ("Gemma3Config", _gemma3),
}


def vlm_family_missing(family: str) -> str | None:
    """Why ``family`` cannot be built with the installed transformers, or None."""
    import transformers

    cls = VLM_FAMILIES[family][0]
    return None if hasattr(transformers, cls) else f"transformers {transformers.__version__} has no {cls}"


def tiny_vlm(
    family: str,
    *,
    vocab_size: int = 48,
    hidden_size: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    vision_layers: int = 1,
    vision_hidden: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A randomly initialised ``family`` VLM (:data:`VLM_FAMILIES`) in ``dtype``, eval mode, its
    vision tower ``vision_layers`` deep (Qwen2.5-VL / Qwen3-VL: one more) and ``vision_hidden`` wide."""
    import transformers

    if family not in VLM_FAMILIES:
        raise ValueError(f"family: expected one of {sorted(VLM_FAMILIES)}, got {family!r}")
    name, build = VLM_FAMILIES[family]
    sizes = (vocab_size, hidden_size, num_heads, num_kv_heads, num_layers, vision_layers, vision_hidden)
    cfg = build(getattr(transformers, name), *sizes)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    text = getattr(cfg, "text_config", None)
    if text is not None:
        text.pad_token_id, text.bos_token_id, text.eos_token_id = 0, 1, 2
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(cfg).to(dtype).eval()


def tiny_image(
    model: torch.nn.Module, size: int, gen: torch.Generator, tokens: tuple[int, int] | None = None
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One random image for ``model`` (from :func:`tiny_vlm`): ``(its placeholder tokens, its model
    keywords)``. ``size`` (>= 1) scales it: Qwen VL images of ``2 x 2*size`` merged patches (or
    ``tokens = (rows, columns)`` of them); LLaVA's and Gemma 3's fixed-size image (``size`` ignored)."""
    cfg: Any = model.config
    dtype = next(model.parameters()).dtype
    vocab = cfg.get_text_config().vocab_size
    if hasattr(cfg.vision_config, "spatial_merge_size"):  # the Qwen VL family
        v = cfg.vision_config
        merge, t = v.spatial_merge_size, v.temporal_patch_size
        rows, cols = tokens or (2, 2 * size)
        h, w = rows * merge, cols * merge  # patches
        dim = v.in_channels * t * v.patch_size**2
        pixels = torch.randn(h * w, dim, generator=gen).to(dtype)
        ids = [vocab + START] + [vocab + IMAGE] * (rows * cols) + [vocab + END]
        return ids, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w]])}
    v = cfg.vision_config
    pixels = torch.randn(1, 3, v.image_size, v.image_size, generator=gen).to(dtype)
    n = getattr(cfg, "mm_tokens_per_image", None) or (v.image_size // v.patch_size) ** 2
    if getattr(cfg, "boi_token_index", None) is not None:
        return [vocab + START] + [vocab + IMAGE] * n + [vocab + END], {"pixel_values": pixels}
    return [vocab + IMAGE] * n, {"pixel_values": pixels}


def tiny_video(
    model: torch.nn.Module, frames: int, gen: torch.Generator
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One random video of ``frames`` frames (``2 x 2`` merged patches each) for a Qwen VL
    :func:`tiny_vlm`, laid out as its processor does: one block of video tokens (Qwen2-VL,
    Qwen2.5-VL) or one block per frame (Qwen3-VL, whose processor puts a timestamp before each:
    one text token here)."""
    cfg: Any = model.config
    v = cfg.vision_config
    vocab = cfg.get_text_config().vocab_size
    merge, rows, cols = v.spatial_merge_size, 2, 2
    h, w = rows * merge, cols * merge
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    pixels = torch.randn(frames * h * w, dim, generator=gen).to(next(model.parameters()).dtype)
    block = [vocab + START] + [vocab + VIDEO] * (rows * cols) + [vocab + END]
    if cfg.model_type.startswith("qwen3"):
        tokens = [tok for f in range(frames) for tok in [3 + f] + block]  # "<timestamp>" then the frame
    else:
        tokens = [vocab + START] + [vocab + VIDEO] * (frames * rows * cols) + [vocab + END]
    return tokens, {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[frames, h, w]])}


#: the tiny processors' words, the vision task's answers (1-9) included (filler ids pad the
#: vocabulary up to the placeholder tokens)
PROCESSOR_WORDS = (
    "a b c d e f g h i j k l m n o p q r s t u v w x y z user assistant : how many what 1 2 3 4 5 6 7 8 9"
).split()
_CHAT = (
    "{% for m in messages %}{{ m['role'] }} : {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}{% endif %} "
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)


#: the config attribute that marks a checkpoint whose processor is :func:`tiny_processor` (its
#: keywords): loaders rebuild it from the config instead of reading processor files
TINY_PROCESSOR = "grpo_parts_tiny_processor"


def tiny_processor(model: torch.nn.Module, max_image_tokens: int = 16) -> Any:
    """An offline processor for a Qwen2-VL / Qwen2.5-VL or LLaVA :func:`tiny_vlm` (what TRL takes as
    ``processing_class``): a word-level tokenizer over :data:`PROCESSOR_WORDS` whose top ids are the
    model's placeholder tokens, the family's image processor sized to the tiny vision tower, and a
    chat template that renders an image part as the family does. A Qwen VL image is resized to at
    most ``max_image_tokens`` merged patches (LLaVA's to its tower's fixed size). Images only: the
    Qwen video processor needs torchvision, which the CPU test set-up does not install."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg: Any = model.config
    vocab = cfg.get_text_config().vocab_size
    qwen = hasattr(cfg.vision_config, "spatial_merge_size")
    specials = (
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
        if qwen
        else ["<image>", "<unused_video>", "<unused_start>", "<unused_end>"]
    )
    fill = vocab - 3 - len(PROCESSOR_WORDS) - len(specials)
    if fill < 0:
        raise ValueError(f"model: expected a vocabulary of >= {vocab - fill} tokens, got {vocab}")
    words = [*PROCESSOR_WORDS, *(f"w{i}" for i in range(fill))]
    ids = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {w: 3 + i for i, w in enumerate(words)}
    ids |= {t: vocab + k for t, k in zip(specials, (IMAGE, VIDEO, START, END))}
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        additional_special_tokens=specials, padding_side="left",
    )  # fmt: skip
    image = "<|vision_start|><|image_pad|><|vision_end|>" if qwen else "<image>"
    if qwen:
        return _qwen_processor(cfg, tokenizer, image, max_image_tokens)
    return _llava_processor(cfg, tokenizer)


def _qwen_processor(cfg: Any, tokenizer: Any, image: str, max_tokens: int) -> Any:
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwenVLProcessor(Qwen2VLProcessor):  # type: ignore[misc]
        """Qwen2-VL's processor without its video processor (which needs torchvision)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    v = cfg.vision_config
    factor = v.patch_size * v.spatial_merge_size
    images = Qwen2VLImageProcessor(
        patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size,
        size={"shortest_edge": factor * factor, "longest_edge": max_tokens * factor * factor},  # pixels
    )  # fmt: skip
    return ImageOnlyQwenVLProcessor(images, tokenizer, chat_template=_CHAT.replace("IMAGE", image))


def _llava_processor(cfg: Any, tokenizer: Any) -> Any:
    from transformers import CLIPImageProcessor, LlavaProcessor

    v = cfg.vision_config
    size = {"height": v.image_size, "width": v.image_size}
    images = CLIPImageProcessor(size=size, crop_size=size, do_center_crop=False)
    return LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=v.patch_size,
        vision_feature_select_strategy="full", image_token="<image>", chat_template=_CHAT.replace("IMAGE", "<image>"),
        num_additional_image_tokens=0,
    )  # fmt: skip
