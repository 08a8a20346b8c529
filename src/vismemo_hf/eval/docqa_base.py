"""``vismemo-docqa-base``: a Qwen2.5-VL-architecture reader (8 decoder layers, window-attention vision tower) trained
here on ``docpage`` pages (256 visual tokens, mostly background, several small glyphs per token, two fonts).

It answers key -> value (``"KEY?"``, the column chosen by an instruction before the image on pages of several
columns), row and column -> cell (``"KEY COL?"``) and value -> key (``"=VALUE?"``). Trained by ``vismemo
train-docqa --reader base`` (CPU, deterministic in ``--seed``, resumable from its checkpoint folder) with the QA
loss plus training-only probes that make reading learnable on a CPU budget:

* at the tower's output and at mid depth each visual token names the glyphs of the records whose centres it
  holds, slot by slot (the few tokens that hold glyphs weighted far above the background);
* at the input of the last layer each token of a record cell names the cell's text, its row's key (value cells),
  its row's first key letter and its column's name, and whether the instruction selected its column (so the
  image's K/V depend on the text before the image);
* the positions that predict the answer name, in the same readout, what they look for: the asked row's first
  key letter and column (key -> value, row and column -> cell), or the asked value (value -> key);
* one head of the last layer is supervised to look, at every answer character, at the tokens of the value cell
  the question is about (value -> key reads the key from that cell's row tag).

The probes are linear heads kept in the training checkpoint only; the packaged model is a plain
``Qwen2_5_VLForConditionalGeneration``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from vismemo_hf.eval import docpage
from vismemo_hf.eval.docqa import TEMPLATE, messages
from vismemo_hf.progress import above_bars, fit_total, progress

logger = logging.getLogger(__name__)

MODEL_NAME = "vismemo-docqa-base"
PACKAGED = Path(__file__).resolve().parents[1] / "models" / "docqa-base"
CLASSES = 1 + len(docpage.GLYPHS)  # 0: nothing
WORD_SLOTS = 12  # content (4), partner (4), row letter (1), column name (2), selected (1)
OCR_LAYER = 4  # hidden state index (output of layer 3); the glyph readout is also asked of the tower's output


def new_processor():
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from vismemo_hf.families import FAMILIES
    from vismemo_hf.offline import byte_tokenizer

    spec = FAMILIES["qwen2_5_vl"]
    small = (docpage.SIZE // 2) ** 2  # training's small pages keep their size; larger images shrink to a page
    image = Qwen2VLImageProcessor(size={"shortest_edge": small, "longest_edge": docpage.SIZE**2}, patch_size=14,
                                  image_mean=list(spec.image_mean), image_std=list(spec.image_std))
    return Qwen2_5_VLProcessor(image_processor=image, tokenizer=byte_tokenizer(),
                               video_processor=Qwen2VLVideoProcessor(), chat_template=TEMPLATE)


def new_model(tokenizer, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1, 3]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


class Probes(torch.nn.Module):
    """Training-only linear readouts of visual tokens (never saved with the model)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.ocr = torch.nn.Linear(hidden, docpage.SLOTS * CLASSES)
        self.word = torch.nn.Linear(hidden, WORD_SLOTS * CLASSES)


def docqa_base_model(path: str | Path | None = None, dtype=torch.float32):
    """``(model, processor)`` of the packaged checkpoint (or ``path``), loaded offline with ``from_pretrained``."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    path = Path(path or PACKAGED)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no {MODEL_NAME} checkpoint at {path}; train one with "
                                "`vismemo train-docqa --reader base`")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(path)


# -- samples and targets -------------------------------------------------------------------------------------
def glyph_class(ch: str) -> int:
    return 1 + docpage.GLYPHS.index(ch)


def sample(rng: random.Random, max_rows: int = 8, layout: str | None = None, full_share: float = 1.0):
    """(page, question) drawn from ``rng``: a full page (``full_share`` of them; up to ``max_rows`` records) or a
    small one (224 px, 2-4 records), sometimes jittered or rescanned, with a random question (value, cell or
    key) and, for some, a neutral instruction before the image."""
    seed = rng.randrange(2**31)
    if rng.random() < full_share:
        page = docpage.random_page(seed, layout=layout, n_rows=rng.randint(min(3, max_rows), max_rows))
    else:
        page = docpage.random_page(seed, layout=layout, side=docpage.SIZE // 2)
    r = rng.random()
    if r < 0.15:
        page = docpage.shift(page, rng.randint(-3, 3), rng.randint(-3, 3))
    elif r < 0.25:
        page = docpage.rescan(page, rng)
    return page, docpage.random_question(rng, page)


def token_targets(page: docpage.DocPage, question: docpage.Question) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, SLOTS) glyph classes of each token's record glyphs by patch (top-left, top-right, bottom-left,
    bottom-right), and (N, WORD_SLOTS) what each record cell's tokens name at the last layer's input (see the
    module docstring)."""
    n = page.n_tokens
    ocr = torch.zeros(n, docpage.SLOTS, dtype=torch.long)
    word = torch.zeros(n, WORD_SLOTS, dtype=torch.long)
    selected_column = question.column if question.kind == "value" and len(page.columns) > 1 else None
    for text in docpage.cell_texts(page):
        if docpage.covered_by_popup(page, text):
            continue
        for g in text.glyphs(page.font):  # each glyph in its patch of its token (2 x 2 patches per token)
            t = docpage.token_of(page, g.cx, g.cy)
            if t is not None:
                x, y = docpage.image_point(page, g.cx, g.cy)
                half = docpage.TOKEN // 2
                ocr[t, 2 * int(y % docpage.TOKEN >= half) + int(x % docpage.TOKEN >= half)] = glyph_class(g.char)
        target = torch.zeros(WORD_SLOTS, dtype=torch.long)
        for i, ch in enumerate(text.text[:4]):
            target[i] = glyph_class(ch)
        if text.kind in ("key", "value"):
            key = page.keys[text.row]
            target[8] = glyph_class(key[0])
        if text.kind == "value":
            for i, ch in enumerate(page.keys[text.row]):
                target[4 + i] = glyph_class(ch)
        if text.kind in ("value", "column") and len(page.columns) > 1:
            name = page.columns[text.column]
            target[9], target[10] = glyph_class(name[0]), glyph_class(name[1])
            if text.column == selected_column and text.kind == "value":
                target[11] = glyph_class("1")
        for t in docpage.text_tokens(page, text):
            word[t] = target
    return ocr, word


def query_target(page: docpage.DocPage, question: docpage.Question) -> torch.Tensor:
    """(WORD_SLOTS,) what the answer positions name (-100: not asked of them): the slots of the value cell's
    target that identify it for this question."""
    target = torch.full((WORD_SLOTS,), -100, dtype=torch.long)
    if question.kind == "key":
        for i, ch in enumerate(page.values[question.row][question.column]):
            target[i] = glyph_class(ch)
        return target
    target[8] = glyph_class(page.keys[question.row][0])
    if len(page.columns) > 1:
        name = page.columns[question.column]
        target[9], target[10] = glyph_class(name[0]), glyph_class(name[1])
        if question.kind == "value":
            target[11] = glyph_class("1")
    return target


def _batch(processor, items):
    """Tokenised batch (left padded so every answer ends its row), labels on the answers, and the samples' targets."""
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template(messages(q.text, q.instruction), add_generation_prompt=True) + q.answer
             + "<|im_end|>" for _, q in items]
    images = [docpage.render(p) for p, _ in items]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    labels = torch.full_like(batch["input_ids"], -100)
    for b, (_, q) in enumerate(items):
        n = len(q.answer) + 1
        labels[b, -n:] = batch["input_ids"][b, -n:]
    return batch, labels


def losses(model, probes, batch, labels, items) -> dict[str, torch.Tensor]:
    out = model(**batch, output_hidden_states=True, output_attentions=True)
    logits = out.logits[:, :-1]
    target = labels[:, 1:]
    qa = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    ids = batch["input_ids"]
    visual = ids == model.config.image_token_id
    ocr_parts, word_parts = zip(*[token_targets(p, q) for p, q in items])
    ocr_t, word_t = torch.cat(ocr_parts), torch.cat(word_parts)  # visual tokens of every sample, in batch order
    ocr_in, ocr_mid = (_slot_loss(probes.ocr(out.hidden_states[at][visual]), ocr_t) for at in (0, OCR_LAYER))
    ocr = (ocr_in + ocr_mid) / 2
    word = _slot_loss(probes.word(out.hidden_states[-2][visual]), word_t)
    predicting = torch.zeros_like(labels, dtype=torch.bool)
    predicting[:, :-1] = labels[:, 1:] != -100
    counts = predicting.sum(1)
    asked = torch.cat([query_target(p, q)[None].expand(int(n), -1) for (p, q), n in zip(items, counts)])
    query = torch.nn.functional.cross_entropy(probes.word(out.hidden_states[-2][predicting]).view(-1, CLASSES),
                                              asked.reshape(-1), ignore_index=-100)
    look = _look_loss(out.attentions[-1][:, 0], visual, items, labels)
    return {"qa": qa, "ocr": ocr, "word": word, "query": query, "look": look}


#: weight of the tokens that hold no record glyph (most of a page): every slot of theirs says "nothing"
BACKGROUND_WEIGHT = 0.05


def _slot_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of per-token slot readouts (T, slots * CLASSES) against (T, slots), the tokens that hold a
    record glyph weighted fully and the background at ``BACKGROUND_WEIGHT`` (else "nothing" everywhere wins)."""
    per_slot = torch.nn.functional.cross_entropy(logits.view(-1, CLASSES), target.view(-1), reduction="none")
    holds = (target > 0).any(-1, keepdim=True).expand_as(target).reshape(-1).float()
    weight = holds + BACKGROUND_WEIGHT * (1 - holds)
    return (per_slot * weight).sum() / weight.sum()


def _look_loss(attention, visual, items, labels) -> torch.Tensor:
    """-log of one last-layer head's attention mass, at the positions predicting each answer character, on the
    tokens of the value cell the question is about."""
    first = visual.int().argmax(1)
    terms = []
    for b, (page, q) in enumerate(items):
        value = next(t for t in docpage.cell_texts(page) if t.kind == "value" and t.row == q.row and t.column == q.column)
        tokens = docpage.text_tokens(page, value)
        if not tokens:
            continue
        cols = torch.tensor(tokens) + first[b]
        predicting = torch.nonzero(labels[b, 1:] != -100).flatten()[:-1]  # the answer's characters, not its end
        mass = attention[b][predicting][:, cols].sum(-1)
        terms.append(-torch.log(mass.clamp_min(1e-6)))
    return torch.cat(terms).mean() if terms else attention.new_zeros(())


@torch.no_grad()
def teacher_forced_accuracy(model, processor, items) -> float:
    """Share of ``items`` whose whole answer the model predicts with the true prefix given (fast, no generate)."""
    model.eval()
    hits = 0
    for i in range(0, len(items), 16):
        chunk = items[i : i + 16]
        batch, labels = _batch(processor, chunk)
        pred = model(**batch).logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        ok = (pred == target) | (target == -100)
        hits += int(ok.all(-1).sum())
    return hits / len(items)


def held_out(n: int = 96, small: bool = False) -> list:
    """Samples no training step draws (seeds from another range), every layout in turn: full pages with up to 8
    rows, or (``small``) the training's small pages."""
    return [sample(random.Random(10**9 + (10**6 if small else 0) + i), layout=docpage.LAYOUTS[i % len(docpage.LAYOUTS)],
                   full_share=0.0 if small else 1.0) for i in range(n)]


#: small-page held-out exact match above which the curriculum moves on (a step of LEVEL_STEP per evaluation)
LEVEL_GATE, LEVEL_STEP = 0.7, 0.15


# -- training ------------------------------------------------------------------------------------------------
def train(out: str | Path, minutes: float = 55.0, max_steps: int = 20000, batch_size: int = 16, lr: float = 1.5e-3,
          total_steps: int | None = None, seed: int = 0, eval_every: int = 250, log=None) -> dict:
    """Train ``vismemo-docqa-base`` into ``out`` for ``minutes`` (or until step ``max_steps``); resumes from ``out``
    when it holds a checkpoint. The data of step s come from ``Random((seed, s))`` and the curriculum level is
    kept in the checkpoint, so a resumed run draws what an uninterrupted one would. The curriculum starts on small
    pages and moves on (more rows, more full pages) each time the small pages' held-out exact match passes
    ``LEVEL_GATE``. ``out`` keeps the latest state (``state/``) and the best model by held-out teacher-forced exact
    match on full pages (``model/``). ``total_steps`` is the length of the cosine schedule (12,000 for a new run;
    kept in the checkpoint, and a resumed run may shorten it to anneal sooner)."""
    out = Path(out)
    state_dir, model_dir = out / "state", out / "model"
    model, processor, info = _resumed(state_dir, seed, batch_size, lr, total_steps)
    total_steps = info.get("total_steps", 12000)
    torch.manual_seed(seed + info["step"])
    probes = Probes(model.config.text_config.hidden_size)
    opt = torch.optim.AdamW(list(model.parameters()) + list(probes.parameters()), lr=lr, weight_decay=0.01)
    if (state_dir / "training_state.pt").is_file():
        saved = torch.load(state_dir / "training_state.pt", weights_only=True)
        probes.load_state_dict(saved["probes"])
        opt.load_state_dict(saved["optimizer"])
    model.set_attn_implementation("eager")  # attention probabilities for the supervised head
    model.train()
    evaluation, small = held_out(), held_out(48, small=True)
    start, step = time.time(), info["step"]
    last = None
    log = log or logger.info  # every 25 steps a line; a bar counts the steps (loss in its postfix)
    first_step = step
    bar = progress(total=max_steps, initial=min(step, max_steps), desc="train-docqa base", unit="step")
    while step < max_steps and time.time() - start < minutes * 60:
        warm = min(1.0, (step + 1) / 200)
        lr_now = lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total_steps))))
        for group in opt.param_groups:
            group["lr"] = lr_now
        rng = random.Random(f"{seed}/{step}")
        level = info["level"]  # small pages first, then full pages with more rows
        max_rows, full_share = 3 + int(5 * level), 0.85 * level
        items = [sample(rng, max_rows, full_share=full_share) for _ in range(batch_size)]
        batch, labels = _batch(processor, items)
        parts = losses(model, probes, batch, labels, items)
        loss = parts["qa"] + parts["ocr"] + parts["word"] + parts["query"] + 0.5 * parts["look"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        last = {k: round(float(v.detach()), 4) for k, v in parts.items()}
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", qa=f"{last['qa']:.3f}", rows=max_rows, refresh=False)
        fit_total(bar, step - first_step, time.time() - start, minutes * 60, max_steps - first_step, first_step)
        bar.update(1)
        if step % 25 == 0:
            parts_text = " ".join(f"{k} {v:.3f}" for k, v in last.items())
            with above_bars():
                log(f"step {step} rows<={max_rows} full {full_share:.2f} lr {lr_now:.2e} {parts_text} "
                    f"t {time.time() - start:.0f}s")
        if step % eval_every == 0:
            bar.set_postfix_str("held-out check")
            acc = teacher_forced_accuracy(model, processor, evaluation)
            small_acc = teacher_forced_accuracy(model, processor, small)
            model.train()
            if small_acc >= LEVEL_GATE:
                info["level"] = round(min(1.0, info["level"] + LEVEL_STEP), 4)
            info["history"].append({"step": step, "losses": last, "heldout_exact": acc, "small_exact": small_acc,
                                    "level": info["level"]})
            with above_bars():
                log(f"  held-out exact (teacher forced) {acc:.3f}, small pages {small_acc:.3f}, level {info['level']}")
            if acc >= info["best"]:
                info["best"] = acc
                _save_model(model, processor, model_dir, {**info, "step": step})
            info["step"] = step
            _save_state(model, processor, probes, opt, state_dir, info)
    bar.close()
    info["step"] = step
    _save_state(model, processor, probes, opt, state_dir, info)
    return info


def _resumed(state_dir: Path, seed: int, batch_size: int, lr: float, total_steps: int | None):
    """(model, processor, training info) from the latest state in ``state_dir``, or new ones; ``total_steps``, when
    given, replaces the schedule length (the change recorded in the info)."""
    if (state_dir / "config.json").is_file():
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(state_dir, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(state_dir)
        info = json.loads((state_dir / "training.json").read_text())
    else:
        processor = new_processor()
        model = new_model(processor.tokenizer, seed)
        info = {"step": 0, "history": [], "best": -1.0, "seed": seed, "batch_size": batch_size, "lr": lr,
                "total_steps": total_steps or 12000}
    if total_steps and total_steps != info.get("total_steps"):
        info.setdefault("schedule_changes", []).append({"step": info["step"], "total_steps": total_steps})
        info["total_steps"] = total_steps
    info.setdefault("level", 0.0)
    return model, processor, info


def _save_model(model, processor, path: Path, info: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    used = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # what serving uses
    model.save_pretrained(path)
    model.set_attn_implementation(used)
    processor.save_pretrained(path)
    (path / "training.json").write_text(json.dumps(info, indent=2))


def _save_state(model, processor, probes, opt, path: Path, info: dict) -> None:
    """The latest weights, probes and optimizer (moments in bfloat16, to keep checkpoints small)."""
    _save_model(model, processor, path, info)
    state = opt.state_dict()  # its per-parameter dicts are the optimizer's own: copy before converting
    state["state"] = {i: {name: (v.to(torch.bfloat16) if name in ("exp_avg", "exp_avg_sq") else v)
                          for name, v in s.items()} for i, s in state["state"].items()}
    tmp = path / "training_state.pt.tmp"
    torch.save({"probes": probes.state_dict(), "optimizer": state}, tmp)
    tmp.replace(path / "training_state.pt")
