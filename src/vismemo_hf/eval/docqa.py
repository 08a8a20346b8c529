"""``vismemo-docqa-tiny``: a Qwen2-VL-architecture model trained here to read synthetic pages.

Random-weight models answer the same whatever the image shows, so a reuse mistake is
invisible with them. This model reads: asked ``"KEY?"`` about a page of any ``synthdoc``
type it answers the 4-digit value of that key's row. Training (``vismemo train-docqa``, CPU)
uses a QA loss, auxiliary glyph readouts through the
vocabulary head and a curriculum on filled rows, plus what made the row lookup learnable:

* at mid depth every visual token names its own glyph (the digits stay readable);
* at the input of the last layer value cells name their row's first key letter (unique on a
  page) and the positions that predict the digits name the asked key's first letter;
* one head of the last layer is supervised to look, at each answer digit, at that digit's cell
  of the asked row (the other heads stay free).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from vismemo_hf.eval import synthdoc
from vismemo_hf.progress import above_bars, fit_total
from vismemo_hf.progress import progress as progress_bar

logger = logging.getLogger(__name__)

MODEL_NAME = "vismemo-docqa-tiny"
PACKAGED = Path(__file__).resolve().parents[1] / "models" / "docqa-tiny"

# A lean template (every text token costs training time on a CPU): the image, the question, a newline.
TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
)


def new_processor():
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from vismemo_hf.offline import byte_tokenizer

    pixels = synthdoc.PAGE_SIZE[0] * synthdoc.PAGE_SIZE[1]
    image = Qwen2VLImageProcessor(size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=14)
    return Qwen2VLProcessor(image_processor=image, tokenizer=byte_tokenizer(), video_processor=Qwen2VLVideoProcessor(),
                            chat_template=TEMPLATE)


def new_model(tokenizer, seed: int = 0):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=3, embed_dim=96, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def messages(question: str, prefix: str = "") -> list[dict]:
    """The image, then the question; ``prefix``: text before the image."""
    content = [{"type": "text", "text": prefix}] if prefix else []
    return [{"role": "user", "content": content + [{"type": "image"}, {"type": "text", "text": question}]}]


def docqa_model(path: str | Path | None = None, dtype=torch.float32):
    """``(model, processor)`` of the packaged checkpoint (or ``path``), loaded offline with ``from_pretrained``."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    path = Path(path or PACKAGED)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no doc-QA checkpoint at {path}; train one with `vismemo train-docqa`")
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(path)


# -- training ----------------------------------------------------------------------------------------------
def _batch(processor, pages, questions, answers, prefixes=None):
    prefixes = prefixes or [""] * len(pages)
    processor.tokenizer.padding_side = "left"  # answers end every row (prefixes make rows differ in length)
    texts = [processor.apply_chat_template(messages(q, p), add_generation_prompt=True) + a + "<|im_end|>"
             for q, a, p in zip(questions, answers, prefixes)]
    images = [synthdoc.render(p) for p in pages]
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def _aux_targets(tokenizer, pages) -> torch.Tensor:
    """(B, 48) byte id each visual token's logits should name (value cells: their row's first key letter)."""
    rows = []
    for page in pages:
        cells = page.cell_text()
        target = [cells[i - i % synthdoc.COLS] if i % synthdoc.COLS >= synthdoc.VALUE_COL and ch != " " else ch
                  for i, ch in enumerate(cells)]
        rows.append([_char_id(tokenizer, ch) for ch in target])
    return torch.tensor(rows)


def _own_targets(tokenizer, pages) -> torch.Tensor:
    """(B, 48) byte id of the glyph in each visual token's own cell."""
    return torch.tensor([[_char_id(tokenizer, ch) for ch in page.cell_text()] for page in pages])


_CHAR_IDS: dict[str, int] = {}


def _char_id(tokenizer, ch: str) -> int:
    if ch not in _CHAR_IDS:
        (_CHAR_IDS[ch],) = tokenizer(ch, add_special_tokens=False).input_ids
    return _CHAR_IDS[ch]


def sample(rng: random.Random, n_rows: int, style: str | None = None):
    """(page, question, answer, prefix): a page of a random type (or ``style``), jittered by up to 2 px."""
    style = style or rng.choice(synthdoc.STYLES)
    page = synthdoc.random_form(rng.randrange(2**31), n_rows=n_rows, style=style)
    page = synthdoc.shift(page, rng.randint(-2, 2), rng.randint(-2, 2))
    key, value = page.rows[rng.randrange(n_rows)]
    prefix = rng.choice(synthdoc.PREFIXES) if rng.random() < 0.2 else ""
    return page, synthdoc.question_for(key), value, prefix


def train(out: str | Path, minutes: float = 55.0, max_steps: int = 20000, batch_size: int = 32, lr: float = 2e-3,
          curriculum_steps: int = 1500, seed: int = 0, resume: str | Path | None = None, log=None) -> dict:
    """Train from scratch, or continue ``resume`` (a saved checkpoint: full curriculum, fresh optimizer). A bar
    counts the steps (loss in its postfix); every 50 steps a line goes to ``log`` (default: this module's logger,
    INFO)."""
    log = log or logger.info
    torch.manual_seed(seed)
    rng = random.Random(seed)
    if resume is not None:
        model, processor = docqa_model(resume)
        info = json.loads((Path(resume) / "training.json").read_text())
        curriculum_steps, first_step, history = 0, info["step"], info["history"]
    else:
        processor = new_processor()
        model = new_model(processor.tokenizer, seed)
        first_step, history = 0, []
    tok = processor.tokenizer
    model.set_attn_implementation("eager")  # attention probabilities for the supervised head (short sequences)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = 200
    held_out = [sample(random.Random(10**9 + i), synthdoc.ROWS) for i in range(128)]
    start, step = time.time(), first_step
    best = -1.0  # the best checkpoint of this run is kept (a resumed run may change the task mix)
    budget = minutes * 60
    bar = progress_bar(total=max_steps, desc="train-docqa tiny", unit="step")
    while step < first_step + max_steps and time.time() - start < budget:
        progress = min(1.0, (time.time() - start) / budget)
        lr_now = lr * min(1.0, (step + 1 - first_step) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr_now
        n_rows = synthdoc.ROWS if curriculum_steps == 0 else 1 + min(
            synthdoc.ROWS - 1, int((synthdoc.ROWS - 1) * step / curriculum_steps + 1e-9))
        pages, questions, answers, prefixes = zip(*[sample(rng, n_rows) for _ in range(batch_size)])
        batch = _batch(processor, pages, questions, answers, prefixes)
        loss, parts = _losses(model, tok, batch, pages, questions, answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        qa_loss = parts["qa"]
        bar.set_postfix(loss=f"{loss.item():.3f}", qa=f"{qa_loss.item():.3f}", rows=n_rows, refresh=False)
        fit_total(bar, step - first_step, time.time() - start, budget, max_steps)
        bar.update(1)
        if step % 50 == 0:
            with above_bars():
                log(f"step {step} rows {n_rows} lr {lr_now:.2e} qa {qa_loss.item():.3f} aux {parts['aux'].item():.3f} "
                    f"query {parts['query'].item():.3f} look {parts['look'].item():.3f} t {time.time() - start:.0f}s")
        if step % 500 == 0:
            bar.set_postfix_str("held-out check")
            acc = teacher_forced_accuracy(model, processor, held_out)
            history.append({"step": step, "seconds": round(time.time() - start), "qa_loss": qa_loss.item(),
                            "heldout_exact": acc})
            with above_bars():
                log(f"  held-out exact (teacher forced) {acc:.3f}")
            if acc >= best:
                best = acc
                save(model, processor, out, {"step": step, "history": history})
            model.train()
    bar.close()
    acc = teacher_forced_accuracy(model, processor, held_out)
    history.append({"step": step, "seconds": round(time.time() - start), "heldout_exact": acc})
    if acc >= best:
        save(model, processor, out, {"step": step, "history": history})
    return {"steps": step, "history": history, "best_heldout_exact": max(best, acc)}


def _losses(model, tok, batch, pages, questions, answers) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of one batch and its parts: the answer (qa), the last layer's key letters (aux) and
    query, the mid-depth glyphs (own) and the looking head's attention (look)."""
    image_id = model.config.image_token_id
    outputs = model(**batch, output_hidden_states=True, output_attentions=True)
    logits = outputs.logits
    ids = batch["input_ids"]
    n_answer = len(answers[0]) + 1  # digits + <|im_end|>
    qa_logits = logits[:, -n_answer - 1 : -1]
    qa_loss = torch.nn.functional.cross_entropy(qa_logits.reshape(-1, qa_logits.shape[-1]),
                                                ids[:, -n_answer:].reshape(-1))
    hidden = outputs.hidden_states  # embeddings, then the output of every layer

    def readout(states):  # what the vocabulary head reads in intermediate states
        return model.lm_head(model.model.language_model.norm(states))

    # into the last layer: value cells name their row's first key letter (what the looking head matches),
    # and the positions that predict the digits name the asked key's first letter (what it looks for)
    last_in = hidden[-2]
    aux = _aux_targets(tok, pages)
    aux_loss = torch.nn.functional.cross_entropy(readout(last_in[ids == image_id]), aux.reshape(-1))
    asked = torch.tensor([_char_id(tok, q[0]) for q in questions]).repeat_interleave(n_answer - 1)
    query_loss = torch.nn.functional.cross_entropy(
        readout(last_in[:, -n_answer - 1 : -2]).reshape(-1, logits.shape[-1]), asked)
    # mid-depth: every visual token names its own glyph (keeps the digits available to read)
    middle = hidden[len(hidden) // 2][ids == image_id]
    own_loss = torch.nn.functional.cross_entropy(readout(middle), _own_targets(tok, pages).reshape(-1))
    look_loss = _look_loss(outputs.attentions[-1][:, 0], ids, image_id, pages, questions, n_answer)
    loss = qa_loss + aux_loss + query_loss + own_loss + look_loss
    return loss, {"qa": qa_loss, "aux": aux_loss, "query": query_loss, "own": own_loss, "look": look_loss}


def _look_loss(attention, ids, image_id, pages, questions, n_answer) -> torch.Tensor:
    """-log attention of one head (B, q, k), at the position predicting answer digit j, to digit j's cell."""
    first_image = (ids == image_id).int().argmax(1)
    length = ids.shape[1]
    losses = []
    for b, (page, question) in enumerate(zip(pages, questions)):
        row = [k for k, _ in page.rows].index(question.rstrip("?"))
        for j in range(n_answer - 1):
            query = length - n_answer - 1 + j
            cell = int(first_image[b]) + row * synthdoc.COLS + synthdoc.VALUE_COL + j
            losses.append(-torch.log(attention[b, query, cell].clamp_min(1e-9)))
    return torch.stack(losses).mean()


@torch.no_grad()
def teacher_forced_accuracy(model, processor, items) -> float:
    model.eval()
    pages, questions, answers, prefixes = zip(*items)
    batch = _batch(processor, pages, questions, answers, prefixes)
    logits = model(**batch).logits
    n_answer = len(answers[0]) + 1
    pred = logits[:, -n_answer - 1 : -1].argmax(-1)
    return float((pred == batch["input_ids"][:, -n_answer:]).all(-1).float().mean())


def save(model, processor, out, info: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    used = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # what serving uses
    model.save_pretrained(out)
    model.set_attn_implementation(used)
    processor.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(info, indent=2))
