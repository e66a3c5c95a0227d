"""Random-init Hugging Face VLM directories built from tiny configs (nothing downloaded), and transformers'
answers for them: shared by tests/test_hf_vlm*.py and bench/hf_vlm_parity.py.

Each directory is what a user's download looks like: `config.json` + safetensors from `save_pretrained`, a
`tokenizer.json` built with `tokenizers` (a word-level vocabulary holding the model's special tokens at their
config ids), `tokenizer_config.json` with the chat template, and the image processor's
`preprocessor_config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

LLAVA_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
SIZES = {  # (vision hidden, vision layers, image, patch, text hidden, text layers, vocab); tests use tiny
    "tiny": (32, 2, 28, 7, 64, 2, 160),
    "small": (64, 3, 56, 8, 128, 3, 320),
    "medium": (256, 4, 112, 14, 512, 4, 4096),  # ~17M parameters: the bench's second size
}


@dataclass
class TinyVlm:
    family: str
    path: Path
    model: object  # the transformers model, eval mode, float32
    image_token_id: int
    mean: tuple
    std: tuple
    tiles: int = 0  # idefics3 image splitting / llava_next's square anyres grid: tiles per side (0: not split)


def save_word_tokenizer(
    path: Path, vocab_size: int, specials: dict[str, int], template: str, bos: str, eos: str, newlines: bool = False
) -> None:
    """A word-level tokenizer of `vocab_size` ids: words w0, w1, ... and the special tokens at their ids.
    `newlines`: "\n" and "\n\n" are tokens of their own (as in BPE vocabularies, where "\n\n" merges), not
    whitespace dropped between words."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, word = {}, 0
    taken = set(specials.values())
    plain = ["\n\n", "\n"] if newlines else []
    for i in range(vocab_size):
        if i in taken:
            continue
        if plain:
            vocab[plain.pop()] = i
        else:
            vocab[f"w{word}"] = i
            word += 1
    vocab.update(specials)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if newlines:  # keep the newline runs, drop the other whitespace
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n\n|\n|\S+"), behavior="removed", invert=True)
    tok.add_special_tokens(list(specials))
    if bos == "<s>":  # LLaMA-style: the tokenizer adds <s> itself
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", specials["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>")
    fast.chat_template = template
    fast.save_pretrained(path)


def _init_range(hidden: int) -> float:
    """Wide enough that logits spread (0.2 at width 64), scaled by 1/sqrt(width) so each layer's gain stays ~1.6
    at every size: a wider model at a fixed 0.2 grows its activations layer by layer, and its float32 error with it."""
    return 1.6 / hidden**0.5


def _widen(model, seed: int, scale: float = 0.1) -> None:
    """Random biases, norms and positions (HF zero/one-initialises them, which would hide a graph ignoring them)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _llava_parts(size: str, tower: str, text: str):
    """The tower and language-model configs LLaVA and LLaVA-NeXT share, and (image size, vocab, image token)."""
    import transformers as tf

    vh, vl, img, patch, th, tl, vocab = SIZES[size]
    vision = dict(hidden_size=vh, intermediate_size=2 * vh, num_hidden_layers=vl, num_attention_heads=4)
    vision.update(image_size=img, patch_size=patch)
    vcfg = tf.CLIPVisionConfig(**vision) if tower == "clip" else tf.SiglipVisionConfig(**vision)
    tcls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[text]
    textkw = dict(hidden_size=th, intermediate_size=2 * th, num_hidden_layers=tl, num_attention_heads=4)
    textkw.update(num_key_value_heads=2, vocab_size=vocab, initializer_range=_init_range(th))
    if text == "mistral":
        textkw["sliding_window"] = None
    return vcfg, tcls(**textkw), img, vocab, vocab - 1


def _save_llava(model, path: Path, seed: int, vocab: int, image_token: int) -> None:
    """Widen the tower and projector, save the model and its word-level tokenizer with LLaVA's template."""
    _widen(model.model.vision_tower, seed)
    _widen(model.model.multi_modal_projector, seed + 1, 0.05)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2, "USER:": 3, "ASSISTANT:": 4, "<image>": image_token}
    save_word_tokenizer(path, vocab, specials, LLAVA_TEMPLATE, "<s>", "</s>")


def make_llava(path: Path, size: str = "tiny", *, tower: str = "clip", text: str = "llama", seed: int = 0, **over):
    import torch
    import transformers as tf

    vcfg, tcfg, img, vocab, image_token = _llava_parts(size, tower, text)
    cfg = tf.LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_id=image_token, **over)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    _save_llava(model, path, seed, vocab, image_token)
    proc = tf.CLIPImageProcessor(size={"shortest_edge": img}, crop_size={"height": img, "width": img})
    if tower == "siglip":
        proc = tf.SiglipImageProcessor(size={"height": img, "width": img})
    proc.save_pretrained(path)
    return TinyVlm("llava", path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std))


def make_llava_next(
    path: Path, size: str = "tiny", *, tower: str = "clip", text: str = "llama", seed: int = 0, tiles: int = 2, **over
):
    """LLaVA-NeXT with pinpoints [[M, 2M], [2M, M], [tiles*M, tiles*M]] (M the tower's image size): a square
    frame of tiles*M px is cut into tiles x tiles crops + the base image. A SigLIP tower (no class token) needs
    `vision_feature_select_strategy='full'` for its crops to be whole patch grids."""
    import torch
    import transformers as tf

    vcfg, tcfg, img, vocab, image_token = _llava_parts(size, tower, text)
    points = [[img, 2 * img], [2 * img, img], [tiles * img, tiles * img]]
    cfg = tf.LlavaNextConfig(
        vision_config=vcfg, text_config=tcfg, image_token_id=image_token, image_grid_pinpoints=points, **over
    )
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(cfg).eval()
    _save_llava(model, path, seed, vocab, image_token)
    cls = getattr(tf, "LlavaNextImageProcessorPil", tf.LlavaNextImageProcessor)
    proc = cls(size={"shortest_edge": img}, crop_size={"height": img, "width": img}, image_grid_pinpoints=points)
    proc.save_pretrained(path)
    return TinyVlm("llava_next", path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std), tiles)


def make_llava_next_geometry(path: Path, *, layers: int = 2, seed: int = 0) -> TinyVlm:
    """llava-v1.6's vision geometry (a CLIP-L/14-336 tower, 1024 wide; its pinpoints, so a 672 px frame of 2 x 2
    crops + the base image, a span of 576 + 48 x 49 = 2928 tokens; vocab 32064), `layers` tower layers (read at
    -2) and a 1024-wide one-layer LLaMA, random init: the bench's check of the anyres span at full size."""
    import torch
    import transformers as tf

    vcfg = tf.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers, num_attention_heads=16, image_size=336
    )
    vcfg.patch_size = 14
    textkw = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=1, num_attention_heads=8)
    textkw.update(num_key_value_heads=8, vocab_size=32064, initializer_range=_init_range(1024))
    image_token = 32000
    points = [list(p) for p in ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))]
    text = tf.LlamaConfig(**textkw)
    cfg = tf.LlavaNextConfig(
        vision_config=vcfg, text_config=text, image_token_id=image_token, image_grid_pinpoints=points
    )
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(cfg).eval()
    _save_llava(model, path, seed, 32064, image_token)
    cls = getattr(tf, "LlavaNextImageProcessorPil", tf.LlavaNextImageProcessor)
    proc = cls(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, image_grid_pinpoints=points)
    proc.save_pretrained(path)
    return TinyVlm("llava_next", path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std), 2)


def make_idefics3(path: Path, size: str = "tiny", *, family: str = "idefics3", seed: int = 0, tiles: int = 0):
    """`tiles` > 0: the processor splits (`do_image_splitting`), `size.longest_edge` = tiles x the tower's image
    size, so a square image becomes tiles x tiles tiles plus the global image; the tokenizer holds the
    `<row_r_col_c>` markers and newline tokens."""
    import torch
    import transformers as tf

    vh, vl, img, patch, th, tl, vocab = SIZES[size]
    img = patch * (8 if size == "medium" else 4)  # a 4x4 (8x8) grid, pixel-shuffled by 2 to 4 (16) image tokens
    vision = dict(hidden_size=vh, intermediate_size=2 * vh, num_hidden_layers=vl, num_attention_heads=4)
    vision.update(image_size=img, patch_size=patch)
    textkw = dict(model_type="llama", hidden_size=th, intermediate_size=2 * th, num_hidden_layers=tl)
    textkw.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, initializer_range=_init_range(th))
    image_token = vocab - 1
    cls, mcls = {
        "idefics3": (tf.Idefics3Config, tf.Idefics3ForConditionalGeneration),
        "smolvlm": (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration),
    }[family]
    cfg = cls(vision_config=vision, text_config=textkw, image_token_id=image_token, scale_factor=2)
    torch.manual_seed(seed)
    model = mcls(cfg).eval()
    _widen(model.model.vision_model, seed)
    _widen(model.model.connector, seed + 1, 0.05)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    specials = {
        "<unk>": 0,
        "<|im_start|>": 1,
        "<end_of_utterance>": 2,
        "User:": 3,
        "Assistant:": 4,
        "<fake_token_around_image>": 5,
        "<global-img>": 6,
        "<image>": image_token,
    }
    for r in range(tiles):
        for c in range(tiles):
            specials[f"<row_{r + 1}_col_{c + 1}>"] = 7 + r * tiles + c
    save_word_tokenizer(
        path, vocab, specials, IDEFICS3_TEMPLATE, "<|im_start|>", "<end_of_utterance>", newlines=tiles > 0
    )
    kw = {"size": {"longest_edge": tiles * img}} if tiles else {}
    proc = tf.Idefics3ImageProcessor(do_image_splitting=tiles > 0, max_image_size={"longest_edge": img}, **kw)
    proc.save_pretrained(path)
    return TinyVlm(family, path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std), tiles)


def make_smolvlm_geometry(path: Path, *, layers: int = 1, seed: int = 0) -> TinyVlm:
    """SmolVLM-256M's geometry and widths (SigLIP 768 wide at 512 px, patch 16, scale_factor 4; a 576-wide
    LLaMA, vocab 49280; its processor's size 2048 and 512 px tiles: 4 x 4 tiles + the global image, 17 x 64
    image tokens), `layers` deep on both sides, random init: the bench's check of the split span at full size."""
    import torch
    import transformers as tf

    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=12)
    vision.update(image_size=512, patch_size=16)
    textkw = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=layers)
    textkw.update(num_attention_heads=9, num_key_value_heads=3, vocab_size=49280, initializer_range=_init_range(576))
    image_token = 49190
    cfg = tf.SmolVLMConfig(vision_config=vision, text_config=textkw, image_token_id=image_token, scale_factor=4)
    torch.manual_seed(seed)
    model = tf.SmolVLMForConditionalGeneration(cfg).eval()
    _widen(model.model.vision_model, seed)
    _widen(model.model.connector, seed + 1, 0.05)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    specials = {"<unk>": 0, "<|im_start|>": 1, "<end_of_utterance>": 2, "User:": 3, "Assistant:": 4}
    specials.update({"<fake_token_around_image>": 49189, "<global-img>": 49152, "<image>": image_token})
    specials.update({f"<row_{r + 1}_col_{c + 1}>": 49153 + 6 * r + c for r in range(6) for c in range(6)})
    save_word_tokenizer(path, 49280, specials, IDEFICS3_TEMPLATE, "<|im_start|>", "<end_of_utterance>", newlines=True)
    kw = dict(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512})
    proc = tf.Idefics3ImageProcessor(do_image_splitting=True, **kw)
    proc.save_pretrained(path)
    return TinyVlm("smolvlm", path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std), 4)


def hf_pixels(vlm: TinyVlm, gray: np.ndarray):
    """What transformers' image processor gives for a grey display frame in [0, 1] already at the tower's size:
    the frame as RGB, normalised per channel (the resize is edgekit's preprocessing, not compared here)."""
    import torch

    mean, std = (np.asarray(v, np.float32)[:, None, None] for v in (vlm.mean, vlm.std))
    if vlm.tiles:  # the crops row by row and the frame averaged over r x r blocks (llava_next: first, idefics3: last)
        r, m = vlm.tiles, gray.shape[0] // vlm.tiles
        crops = [gray[i * m : (i + 1) * m, j * m : (j + 1) * m] for i in range(r) for j in range(r)]
        whole = gray.reshape(m, r, m, r).mean(axis=(1, 3), dtype=np.float32)
        images = np.stack([whole, *crops] if vlm.family == "llava_next" else [*crops, whole])
        return torch.tensor(((np.repeat(images[:, None], 3, axis=1) - mean) / std)[None].astype(np.float32))
    x = torch.tensor(((np.repeat(gray[None], 3, axis=0) - mean) / std)[None].astype(np.float32))
    return x[None] if vlm.family != "llava" else x  # Idefics3 takes (batch, images, C, H, W)


def hf_reference(
    vlm: TinyVlm, span_ids: list[int], gray: np.ndarray, text_ids: list[int], new_tokens: int, slot: int = 0
):
    """transformers' prefill logits (every position) and greedy `generate()` tokens for the text with the span
    before its token `slot` (0: span + text)."""
    import torch

    ids = torch.tensor([[*text_ids[:slot], *span_ids, *text_ids[slot:]]])
    images = {"pixel_values": hf_pixels(vlm, gray)}
    if vlm.family == "llava_next":
        images["image_sizes"] = torch.tensor([list(gray.shape)])
    with torch.no_grad():
        logits = vlm.model(input_ids=ids, **images).logits[0].numpy()
        out = vlm.model.generate(input_ids=ids, **images, max_new_tokens=new_tokens, do_sample=False)
    return logits, out[0, ids.shape[1] :].tolist()


def hf_processor(vlm: TinyVlm):
    """transformers' own processor for the directory, built from its files (nothing downloaded): it renders the
    chat template and expands the image token where the template puts it, as a user's pipeline would."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(vlm.path)
    image = tf.AutoImageProcessor.from_pretrained(vlm.path)
    cfg = vlm.model.config
    if vlm.family == "llava_next":
        return tf.LlavaNextProcessor(
            image_processor=image,
            tokenizer=tok,
            patch_size=cfg.vision_config.patch_size,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            num_additional_image_tokens=1 if cfg.vision_config.model_type == "clip_vision_model" else 0,
            chat_template=tok.chat_template,
        )
    if vlm.family == "llava":
        clip = cfg.vision_config.model_type == "clip_vision_model"
        return tf.LlavaProcessor(
            image_processor=image,
            tokenizer=tok,
            patch_size=cfg.vision_config.patch_size,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
            num_additional_image_tokens=1 if clip else 0,  # CLIP's class token
            chat_template=tok.chat_template,
        )
    seq = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2 // cfg.scale_factor**2
    cls = tf.Idefics3Processor if vlm.family == "idefics3" else tf.SmolVLMProcessor
    extra = {} if vlm.family == "idefics3" else {"video_processor": None}
    return cls(image_processor=image, tokenizer=tok, image_seq_len=seq, chat_template=tok.chat_template, **extra)


def processor_inputs(vlm: TinyVlm, image: np.ndarray, prompt: str, **images_kwargs) -> dict:
    """What the processor gives for one user turn (the image, then `prompt`) with the generation prompt, for a
    grey 8-bit image already at the tower's size (no resize or crop: edgekit's preprocessing is not compared here;
    edgekit's graph sees `image / 255`): `input_ids` with the image span expanded, and `pixel_values`."""
    proc = hf_processor(vlm)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    rgb = np.repeat(np.asarray(image, np.uint8)[:, :, None], 3, axis=-1)
    kw = {"do_center_crop": False} if vlm.family.startswith("llava") else {"do_image_splitting": vlm.tiles > 0}
    out = proc(text=text, images=[rgb], do_resize=False, return_tensors="pt", **kw, **images_kwargs)
    if vlm.family == "llava_next":  # the image's size picks the anyres grid; the crops are not resized
        return {k: out[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    return {"input_ids": out["input_ids"], "pixel_values": out["pixel_values"]}


QWEN2_VL_TEMPLATE = (  # Qwen2-VL-Instruct's chat template (images and text; its video branch left out)
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
QWEN2_VL_SIZES = {  # (vision embed, depth, patch, frame side, text hidden, text layers, vocab, mrope_section)
    "tiny": (32, 2, 7, 56, 64, 2, 160, [2, 3, 3]),  # an 8 x 8 patch grid, 4 x 4 merged: 16 image tokens
    "medium": (256, 4, 14, 112, 512, 4, 4096, [16, 24, 24]),  # Qwen2-VL's own section, 16 image tokens
}


def make_qwen2_vl(
    path: Path,
    size: str = "tiny",
    *,
    seed: int = 0,
    side: int | None = None,
    tied: bool = False,
    family: str = "qwen2_vl",
    window: int | None = None,
):
    """Qwen2-VL (or Qwen2.5-VL: RMSNorm + SwiGLU vision blocks, windows of `window` px (default 4 merge units)
    but in its last block) with its processor pinned to one square side (`min_pixels = max_pixels = side**2`, the
    fixed resolution edgekit builds), its chat template and a word-level tokenizer holding its special tokens."""
    import torch
    import transformers as tf

    vh, depth, patch, img, th, tl, vocab, section = QWEN2_VL_SIZES[size]
    img = side or img
    vision = dict(depth=depth, embed_dim=vh, hidden_size=th, num_heads=4, mlp_ratio=2, patch_size=patch)
    if family == "qwen2_5_vl":
        vision = dict(depth=depth, hidden_size=vh, out_hidden_size=th, num_heads=4, intermediate_size=2 * vh)
        vision.update(patch_size=patch, window_size=window or 2 * 2 * patch, fullatt_block_indexes=[depth - 1])
    vision.update(spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    text = dict(hidden_size=th, intermediate_size=2 * th, num_hidden_layers=tl, num_attention_heads=4)
    text.update(num_key_value_heads=2, vocab_size=vocab, initializer_range=_init_range(th), bos_token_id=None)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    text.update(eos_token_id=2, rope_parameters=rope)
    image_token = vocab - 1
    cls, mcls = {
        "qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
    }[family]
    cfg = cls(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token,
        video_token_id=vocab - 2,
        vision_start_token_id=3,
        vision_end_token_id=4,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = mcls(cfg).eval()
    _widen(model.model.visual, seed)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    specials = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4}
    specials.update({"<|video_pad|>": vocab - 2, "<|image_pad|>": image_token})
    save_word_tokenizer(path, vocab, specials, QWEN2_VL_TEMPLATE, "<|im_start|>", "<|im_end|>", newlines=True)
    proc = tf.Qwen2VLImageProcessor(
        size={"shortest_edge": img * img, "longest_edge": img * img}, patch_size=patch, merge_size=2
    )
    proc.save_pretrained(path)
    return TinyVlm(family, path, model, image_token, tuple(proc.image_mean), tuple(proc.image_std))


def qwen2_vl_inputs(vlm: TinyVlm, image: np.ndarray, prompt: str) -> dict:
    """What Qwen2VLProcessor gives for one user turn (the image, then `prompt`) with the generation prompt: the
    chat template rendered by the directory's tokenizer, `<|image_pad|>` expanded to grid_t*grid_h*grid_w /
    merge_size**2 tokens (the processor's `replace_image_token`), and the image processor's own `pixel_values`
    and `image_grid_thw` for the grey 8-bit image (resized by it, BICUBIC, to its fixed side), plus the
    `mm_token_type_ids` the processor returns. (Qwen2VLProcessor itself will not construct without
    torchvision's video processor; its image processor and tokenizer are what it calls.)"""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(vlm.path)
    proc = tf.AutoImageProcessor.from_pretrained(vlm.path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    rgb = np.repeat(np.asarray(image, np.uint8)[:, :, None], 3, axis=-1)
    out = proc(images=[rgb], return_tensors="pt")
    n = int(out["image_grid_thw"][0].prod()) // proc.merge_size**2
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    return {
        "input_ids": ids,
        "pixel_values": out["pixel_values"],
        "image_grid_thw": out["image_grid_thw"],
        "mm_token_type_ids": (ids == vlm.image_token_id).int(),
    }


QWEN2_VL_2B = {  # Qwen2-VL-2B-Instruct's config.json (vision and text), its chat template's token ids
    "vision": dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14),
    "text": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "kv_heads": 2,
    "vocab": 151936,
    "ids": dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653),
}


def qwen2_vl_2b_config(side: int = 448, vision_layers: int | None = None, text_layers: int | None = None):
    """Qwen2-VL-2B-Instruct's geometry (`vision_layers` / `text_layers` to cut its depth) and the processor
    pinned to `side` px."""
    import transformers as tf

    g = QWEN2_VL_2B
    vision = {**g["vision"], "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    vision["depth"] = vision_layers or vision["depth"]
    text = {**g["text"], "num_key_value_heads": g["kv_heads"], "vocab_size": g["vocab"], "rms_norm_eps": 1e-6}
    text["num_hidden_layers"] = text_layers or text["num_hidden_layers"]
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    text.update(initializer_range=_init_range(1536), bos_token_id=None, eos_token_id=151645)
    cfg = tf.Qwen2VLConfig(vision_config=vision, text_config=text, tie_word_embeddings=True, **g["ids"])
    proc = tf.Qwen2VLImageProcessor(size={"shortest_edge": side * side, "longest_edge": side * side})
    return cfg, proc


def save_qwen2_vl_serving(path: Path, proc, vocab: int = 151936) -> None:
    """Qwen2-VL-2B's special tokens at their ids in a word-level tokenizer, its chat template, the processor."""
    specials = {"<unk>": 0, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652}
    specials.update({"<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656})
    save_word_tokenizer(path, vocab, specials, QWEN2_VL_TEMPLATE, "<|im_start|>", "<|im_end|>", newlines=True)
    proc.save_pretrained(path)


def qwen2_5_vl_3b_config(side: int = 448, vision_layers: int = 2, text_layers: int = 1):
    """Qwen2.5-VL-3B-Instruct's widths (a 1280-wide vision tower with 3420-wide SwiGLU, windows of 112 px, a
    2048-wide Qwen2, vocab 151936, tied), `vision_layers` blocks of which the last attends over the whole image."""
    import transformers as tf

    vision = dict(depth=vision_layers, hidden_size=1280, out_hidden_size=2048, intermediate_size=3420, num_heads=16)
    vision.update(patch_size=14, window_size=112, fullatt_block_indexes=[vision_layers - 1], spatial_merge_size=2)
    vision.update(temporal_patch_size=2, in_channels=3, hidden_act="silu")
    text = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=text_layers, num_attention_heads=16)
    text.update(num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6, initializer_range=_init_range(2048))
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
    text.update(bos_token_id=None, eos_token_id=151645)
    cfg = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text, tie_word_embeddings=True, **QWEN2_VL_2B["ids"])
    proc = tf.Qwen2VLImageProcessor(size={"shortest_edge": side * side, "longest_edge": side * side})
    return cfg, proc


def make_qwen2_vl_geometry(
    path: Path, *, layers: int = 1, side: int = 448, seed: int = 0, family: str = "qwen2_vl"
) -> TinyVlm:
    """Qwen2-VL-2B's widths and vocabulary at a 448 px fixed side (32 x 32 patches, 256 image tokens),
    `layers` deep on both sides (Qwen2.5-VL-3B's: two vision blocks, one windowed, one over the whole image,
    and one text layer), random init: the bench's check of the span, M-RoPE and the windows at full size."""
    import torch
    import transformers as tf

    if family == "qwen2_5_vl":
        cfg, proc = qwen2_5_vl_3b_config(side)
        mcls = tf.Qwen2_5_VLForConditionalGeneration
    else:
        cfg, proc = qwen2_vl_2b_config(side, layers, layers)
        mcls = tf.Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = mcls(cfg).eval()
    _widen(model.model.visual, seed, 0.02)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    save_qwen2_vl_serving(path, proc)
    return TinyVlm(family, path, model, 151655, tuple(proc.image_mean), tuple(proc.image_std))
