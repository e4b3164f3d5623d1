"""The masked-patch vision transformer.

Read top to bottom: positions, attention, feed-forward, block, then the full model.

Shapes: B batch, N patches (tokens), P pixels per patch, D hidden_dim, H heads, K key/value heads
(K = H unless grouped-query attention), d = D / H head dim, F ffn_dim, M masked patches per image,
C token classes, g patches per side of the grid (N = g * g).

The model follows docs/notation.md: each patch's pixels (masked ones replaced by `fill`) are projected up
to D (Z = X A_up^T + b_up), a positional embedding P (N, D) is added, the blocks mix the
tokens, and a linear layer maps each token to C class logits (logits = C A_down^T + b_down).
With `mask.fill: learned`, a masked patch's embedded token is instead a trained vector (D,), as in
BEiT and SimMIM, before P is added.
Its variants are config choices: RMSNorm, SwiGLU, grouped-query attention, and 2D
positions (fixed sin-cos added to the tokens, or rotary applied to queries and keys).
With `model.decoder: self | cross`, the blocks here are an encoder over the visible patches only
and a decoder (vitmask.model.decoder) predicts the masked ones; see `MaskedPatchViT`.
"""

import torch
from torch import nn

from vitmask.config import Config, ModelConfig
from vitmask.model.decoder import Decoder
from vitmask.model.layers import Block, gather_tokens, make_norm
from vitmask.model.masked_input import apply_fill, mask_to_ids, visible_ids
from vitmask.model.positions import attach_positions, gather_rope, rope_tables


class MaskedPatchViT(nn.Module):
    """Predicts the class of masked patches from the visible ones.

    `model.decoder: none` (the default) is one stack over all N tokens, masked ones standing in as
    `fill`. With `self` or `cross`, the stack is an encoder over the visible tokens only and a
    `Decoder` (vitmask.model.decoder) predicts the masked ones: forward = `forward_encoder` then
    `forward_decoder`.
    """

    def __init__(self, cfg: ModelConfig, num_patches: int, patch_dim: int, num_classes: int, fill: float | str):
        super().__init__()
        d = cfg.hidden_dim
        self.fill = fill if cfg.decoder == "none" else None  # a decoder brings its own mask token
        self.zero_init_residual = cfg.zero_init_residual
        self.embed = nn.Linear(patch_dim, d)  # A_up, b_up
        if self.fill == "learned":
            self.mask_token = nn.Parameter(torch.zeros(d))  # the embedding of every masked patch
        attach_positions(self, cfg, d, cfg.head_dim, num_patches)  # P (N, D) and/or rotary tables
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        # a pre-norm stack leaves its residual stream un-normalised: normalise once before the head
        self.norm = make_norm(cfg.norm, d) if cfg.norm_position == "pre" else nn.Identity()
        self.decoder = None
        if cfg.decoder != "none":
            self.decoder = Decoder(cfg, num_patches)
            d = cfg.decoder_width  # the head reads the decoder's features
        self.head = nn.Linear(d, num_classes)  # A_down, b_down
        self.init_weights()

    def init_weights(self) -> None:
        """All initialisation rules in one place.

        - Linear weights: Xavier-uniform, which keeps activation variance steady through the
          projections (as MAE does); biases zero, so the model starts unbiased between classes.
        - A learned positional embedding: normal with std 0.02, small beside the patch embedding so
          early training is driven by content. Fixed positions (sincos2d, rotary) are not trained.
          The learned mask embedding likewise (as in BEiT).
        - The patch embedding's bias, under rope2d alone with no learned mask embedding in the stack (a
          decoder design, or a fill value): normal with std 0.02. Nothing is added to the tokens
          there, so with a zero bias a blank patch would be the zero vector, and an input of blank
          patches alone (a mostly masked digit's border) all zeros, where each LayerNorm's gradient
          is 1/sqrt(eps) ~ 316: 1e20 at the embedding after the encoder's 8 norms, an infinite
          gradient norm at the first step (measured). Elsewhere it stays zero.
        - LayerNorm and RMSNorm: the identity (weight 1, bias 0), torch's default, left as is.
        - The token convolution (`model.token_conv`): torch's default for a convolution, as CPE.
        - With `model.zero_init_residual`, the last linear layer of every residual branch (each
          attention's output projection W_O, each FFN's W_2) starts at zero, so every block starts
          as the identity and the stack as the embedding followed by the head (GPT-2's and
          modded-nanogpt's practice). Without an output projection, attention's branch keeps its init.
        """
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.pos, nn.Parameter):
            nn.init.normal_(self.pos, std=0.02)
        if self.fill == "learned":
            nn.init.normal_(self.mask_token, std=0.02)
        if self.pos is None and self.fill != "learned":
            nn.init.normal_(self.embed.bias, std=0.02)
        if self.decoder is not None:  # the decoder's positions and mask token, by the same rules
            self.decoder.init_weights()
        if self.zero_init_residual:  # every branch adds 0 at first: each block starts as the identity
            for m in self.modules():
                if getattr(m, "branch_output", None) is not None:
                    nn.init.zeros_(m.branch_output.weight)

    def forward(self, patches: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """patches (B, N, P) float pixels, mask (B, N) bool (True = masked), ids (B, M) masked indices.

        Returns logits (B, M, C) for the patches in `ids`, or (B, N, C) for every patch if ids is None.
        The masked patches' pixels are replaced by `fill` (or their tokens by the learned mask
        embedding) here, so callers pass the true pixels. With a decoder, the rows of visible
        patches in the (B, N, C) result are 0: the decoder predicts the masked patches only.
        """
        if self.decoder is not None:
            return self.forward_encoder_decoder(patches, mask, ids)
        x = self.embed_masked(patches, mask)  # (B, N, D)
        if self.pos is not None:
            x = x + self.pos  # (B, N, D)
        rope = rope_tables(self)
        for block in self.blocks[:-1]:
            x = block(x, rope)  # (B, N, D)
        # the last block computes only the tokens the head reads: the masked ones when ids is given
        x = self.blocks[-1](x, rope, ids)  # (B, M or N, D)
        return self.head(self.norm(x))  # (B, M or N, C)

    def embed_masked(self, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """patches (B, N, P), mask (B, N) True = masked -> (B, N, D) embedded tokens, the masked ones as the
        one-stack design sees them: pixels replaced by `fill`, or the token by the learned mask embedding."""
        if self.fill is None:
            raise ValueError("a model with a decoder design has no masked input to its encoder: pass keep instead")
        if self.fill == "learned":
            return torch.where(mask.unsqueeze(-1), self.mask_token, self.embed(patches))  # (B, N, D)
        return self.embed(apply_fill(patches, mask, self.fill))  # (B, N, D)

    # ---- the encoder-decoder designs (model.decoder: self | cross) ---------------------------
    def forward_encoder(
        self,
        patches: torch.Tensor,
        keep: torch.Tensor | None = None,
        depth: int | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """patches (B, N, P), keep (B, V) the visible patches' indices (None: all N) -> (B, V, D).

        The encoder sees the patches in `keep` only, gathered into a dense tensor; each token gets
        the position of its own patch (added, or rotated in by rope2d). A pre-norm stack ends in its norm.
        With `depth` K, the output of block K instead (0: the embedded patches), not normalised.
        With `mask` (B, N) True = masked (keep None; a model without a decoder design), all N tokens go
        through, the masked ones as `forward` gives them (`embed_masked`).
        """
        rope = rope_tables(self)
        if keep is None:
            x = self.embed(patches) if mask is None else self.embed_masked(patches, mask)  # (B, N, D)
            pos = self.pos  # (N, D) or None
        else:
            x = self.embed(gather_tokens(patches, keep))  # (B, V, D)
            pos = None if self.pos is None else self.pos[keep]  # (B, V, D)
            rope = None if rope is None else gather_rope(rope, keep)  # 2 x (B, 1, V, d/2)
        if pos is not None:
            x = x + pos  # (B, V, D)
        if x.shape[1] > 0:  # every patch masked: no token, nothing to compute
            for block in self.blocks[:depth]:  # every block, or the first K
                x = block(x, rope)  # (B, V, D)
        return self.norm(x) if depth is None else x  # (B, V, D)

    def forward_decoder(self, encoded: torch.Tensor, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """encoded (B, V, D) at the visible positions keep (B, V) -> logits (B, M, C) for the masked ids (B, M)."""
        return self.head(self.decoder(encoded, keep, ids))  # (B, M, C)

    def forward_encoder_decoder(
        self, patches: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward` with a decoder: logits (B, M, C) for ids, or (B, N, C) with zero rows at visible patches."""
        every = ids is None
        if every:
            ids = mask_to_ids(mask)  # (B, M); reads M from the mask (a host sync: never in a training step)
        keep = visible_ids(mask, ids.shape[1])  # (B, V)
        logits = self.forward_decoder(self.forward_encoder(patches, keep), keep, ids)  # (B, M, C)
        if not every:
            return logits
        full = logits.new_zeros(*mask.shape, logits.shape[-1])  # (B, N, C)
        return full.scatter(1, ids.unsqueeze(-1).expand_as(logits), logits)  # (B, N, C)


def build_model(cfg: Config) -> MaskedPatchViT:
    data = cfg.data
    return MaskedPatchViT(cfg.model, data.num_patches, data.patch_dim, data.num_classes, cfg.mask.fill)


def predict_every_patch(model: torch.nn.Module, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """patches (B, N, P), mask (B, N) True = hidden, any count per row -> model(patches, mask): (B, N, C).

    An encoder-decoder model (model.decoder self | cross) gathers each row's visible patches into
    one dense tensor, so one call needs the same hidden count in every row: rows are grouped by
    count, one call per distinct count (a host sync; never in a training step). The single-stack
    model takes any mask in one call.
    """
    if getattr(model, "decoder", None) is None:
        return model(patches, mask)  # (B, N, C)
    counts = mask.sum(1)  # (B,)
    distinct = counts.unique()
    if len(distinct) == 1:
        return model(patches, mask)  # (B, N, C)
    out = None
    for m in distinct:
        rows = (counts == m).nonzero().squeeze(1)  # (b,)
        logits = model(patches[rows], mask[rows])  # (b, N, C)
        out = logits.new_empty(*mask.shape, logits.shape[-1]) if out is None else out  # (B, N, C)
        out[rows] = logits
    return out
