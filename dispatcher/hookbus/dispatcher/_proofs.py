"""Answer proofs, as the approvals read and write them: the kernel's (`hookbus._core.proofs`),
which the ``ai`` integration's tool approvals share."""

from hookbus._core.proofs import first_proof, read_proofs, write_proof

__all__ = ["first_proof", "read_proofs", "write_proof"]
