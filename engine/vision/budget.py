"""How much image work one step takes on (the scheduler asks, engine/core/scheduler.py).

Two limits per step, each cutting a prefill chunk short just before the image token where it
would be passed:
- encoder work: the images a step starts (first reaches, not yet counted for their sequence)
  may hold at most `max_encoder_tokens` tokens together, so that a request with many images
  cannot stall the decodes batched with it; the first image of a step always fits, however
  large, so every image is encoded in some step;
- image rows: at most `max_image_rows` image tokens in a step (the model's room for their
  M-RoPE rows, engine/models/qwen2_5_vl.py).
The encoder runs once per image, in the step whose chunk first reaches the image (its tokens
may span several chunks: engine/vision/encoder_cache.py keeps its output meanwhile).
With whole_images (Gemma 3, whose image tokens attend to each other: engine/vision/
gemma3_attention.py) a chunk never ends inside an image: it stops before the image, or waits
for a step with room for the image's remaining tokens.
"""
from __future__ import annotations


class EncoderBudget:
    def __init__(self, max_encoder_tokens: int, max_image_rows: int,
                 whole_images: bool = False):
        self.max_encoder_tokens = max_encoder_tokens
        self.max_image_rows = max_image_rows
        self.whole_images = whole_images
        self.encoder_tokens = 0     # this step's
        self.image_rows = 0
        self.num_cut = 0            # chunks cut short by either limit (tests, metrics)

    def begin_step(self):
        self.encoder_tokens = self.image_rows = 0

    def limit(self, seq, start: int, n: int) -> int:
        """The tokens, of the n from `start`, that seq's chunk may compute this step."""
        mm = seq.mm
        end = start + n
        for i in mm.overlapping(start, end):
            im = mm.images[i]
            first = max(start, im.offset)
            if self.whole_images and end < im.end:
                end = im.offset if im.offset > start else start
                break
            if i not in mm.budgeted:
                if self.encoder_tokens and (self.encoder_tokens + im.num_tokens
                                            > self.max_encoder_tokens):
                    end = first
                    break
                self.encoder_tokens += im.num_tokens
            rows = min(end, im.end) - first
            if self.image_rows + rows > self.max_image_rows:
                end = first + self.max_image_rows - self.image_rows
                self.image_rows = self.max_image_rows
                break
            self.image_rows += rows
        if end < start + n:
            self.num_cut += 1
        return end - start

    @staticmethod
    def commit(out):
        """The images a scheduled step reaches are counted for their sequences."""
        for seq, a, n in zip(out.seqs, out.num_computed, out.num_new_tokens):
            if seq.mm is not None:
                seq.mm.budgeted.update(seq.mm.overlapping(a, a + n))


def check_whole_image_room(image_tokens: int, max_num_batched_tokens: int,
                           prefill_chunk_size: int) -> None:
    """A whole_images model's image must fit in one step's chunk, or its prompt never runs."""
    room = min(max_num_batched_tokens, prefill_chunk_size or max_num_batched_tokens)
    if image_tokens > room:
        raise ValueError(f"an image is {image_tokens} tokens, which must be computed in one "
                         f"step (their attention is bidirectional); a step takes {room} "
                         "(--max-num-batched-tokens / --prefill-chunk-size)")
