"""What one rank of a split engine holds of a LoRA adapter, cut as vLLM cuts it, so that the
rank's delta is its share of the whole model's and the ranks' shares add up exactly.

Tensor parallel: a column-parallel projection (q/k/v, gate/up) keeps A (r, in) whole and takes
the rows of B (out, r) that are the rank's output columns (its query heads, its KV heads, a KV head
replicated where there are fewer than ranks, its slice of the intermediate size); a row-parallel
one (o, down) takes the columns of A that are the rank's input columns and keeps B whole, its
delta a partial sum like the base projection's, added before the layer's all-reduce
(engine/parallel/layers.py). Both cuts are the base weight's own (ShardPlan.cut of the module's
`.weight`): a rank's B rows are its W rows, its A columns its W columns.

Pipeline parallel: a stage holds the adapter's tensors of its own layers only, renumbered from 0
as its model's layers are (PipelineStage.tensor_name).
"""
from __future__ import annotations

from engine.parallel.cuts import cut_array


class AdapterShard:
    def __init__(self, plan=None, stage=None):
        """plan: the rank's engine.parallel.sharding.ShardPlan (tensor parallel), stage: its
        PipelineStage (pipeline parallel); either may be None."""
        self.plan, self.stage = plan, stage

    @classmethod
    def of(cls, local_config, model_config, expert_parallel: bool = False):
        """The shard of the rank whose model was built with `local_config` (the whole model's:
        model_config), or None when the model is whole."""
        tp = local_config.tensor_parallel
        stage = local_config.pipeline
        if tp is None and stage is None:
            return None
        plan = None
        if tp is not None:
            from engine.parallel.sharding import ShardPlan
            plan = ShardPlan(model_config, tp.rank, tp.size, expert_parallel)
        return cls(plan, stage)

    def layer(self, layer: int) -> int | None:
        """The rank's index of the whole model's layer, or None when another stage holds it."""
        if self.stage is None:
            return layer
        if not self.stage.first_layer <= layer < self.stage.end_layer:
            return None
        return layer - self.stage.first_layer

    def cut(self, layer: int, module: str, a, b):
        """(A, B) of the rank for the module (as PEFT names it under model.layers.N.) of a
        layer; a and b are the whole model's, A (r, in) and B (out, r)."""
        if self.plan is None:
            return a, b
        name = f"model.layers.{layer}.{module}.weight"
        cut = self.plan.cut(name, (b.shape[0], a.shape[1]))
        if cut is None:
            return a, b
        if cut.axis == 0:           # column-parallel: the rank's output rows of W are B's rows
            return a, cut_array(b, cut)
        return cut_array(a, cut), b  # row-parallel: W's input columns are A's columns
