"""A CUDA graph piece's stand-in for the CPU: what a piecewise capture's cuts are can be checked without a GPU."""

from __future__ import annotations


class StandInPiece:
    """Takes torch.cuda.CUDAGraph's place (monkeypatched): capture_begin / capture_end recorded, nothing captured
    (the pass runs eagerly while "capturing"), a replay does nothing."""

    def __init__(self) -> None:
        self.began = self.ended = False

    def capture_begin(self, pool: object = None) -> None:
        self.began = True

    def capture_end(self) -> None:
        self.ended = True

    def replay(self) -> None:
        pass
