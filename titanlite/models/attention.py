"""Where a fork imports the document masks and attention from: they live in
titanlite.models.common.document_attention."""

from titanlite.models.common.document_attention import (
    DocumentMask,
    attend,
    block_document_mask,
    dense_document_mask,
    document_ids,
    document_mask,
)

__all__ = [
    "DocumentMask",
    "attend",
    "block_document_mask",
    "dense_document_mask",
    "document_ids",
    "document_mask",
]
