"""Decoupled-momentum optimizers (paper 001): DeMo-SGD and decoupled AdamW.

Plain ``torch.optim.Optimizer`` subclasses that own their communication through a replicator
and a :class:`~quietsync.transport.Transport`; usable in any training loop and by the
``demo`` / ``flexdemo`` strategies.
"""

from .decoupled import DecoupledOptimizer, DecoupledStep, check_replication_schedule
from .decoupled_adamw import DecoupledAdamW
from .demo_sgd import DeMoSGD

__all__ = ["DecoupledOptimizer", "DecoupledStep", "DecoupledAdamW", "DeMoSGD", "check_replication_schedule"]
