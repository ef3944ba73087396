"""Wire formats of the NIXL connector: compatibility info, side-channel messages, notifs.

Side-channel messages (msgpack dicts over ``kvconnector.nixl.side_channel``), all with
``kind``:

* ``handshake`` D -> P: ``engine_id``, ``incarnation``, ``compat``, ``ranks`` (each rank's
  transport metadata), ``address`` (D's side channel). Reply: P's ``engine_id``,
  ``incarnation``, ``compat``, ``ranks`` -- or ``ok: False`` with the mismatch named.
* ``reserve`` D -> P: ``transfer_id``, ``d_request_id``, ``engine_id``, ``incarnation``,
  ``block_ids`` (D blocks to write), ``skip_blocks`` (leading prompt blocks D already has).
* ``cancel`` D -> P: ``transfer_id``. Reply ``state``: ``cancelled`` (nothing was or will be
  written) or ``in_flight`` (a WRITE may still land; wait for its notif or a deadline).
* ``transfer_failed`` P -> D: ``d_request_id``, ``reason``, ``safe``: the KV will not come
  and, when ``safe``, nothing more will be written into its blocks.
* ``ping``: liveness; reply carries ``engine_id`` and ``incarnation``.

A NIXL notification (P rank -> D rank, delivered after that rank's WRITE landed) is a
msgpack dict: ``r`` D request id, ``t`` transfer id, ``n`` parts that D rank expects,
``ft`` the first token sampled by P.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgpack

CONNECTOR_VERSION = 1
LAYOUT = "block,layer,kv,head,token,dim"

# Compared in this order; the first difference is the error message.
COMPAT_KEYS = (
    "connector_version",
    "layout",
    "model",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
    "tp_size",
)


def model_fingerprint(model: str, seed: int) -> str:
    """Identifies the weights: 'tiny' by its seed, a checkpoint by its config and sizes."""
    if model == "tiny":
        return f"tiny/seed={seed}"
    h = hashlib.sha256()
    with open(os.path.join(model, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(os.path.join(model, name))}".encode())
    return f"{os.path.basename(os.path.normpath(model))}/{h.hexdigest()[:16]}"


def check_compat(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """None when compatible, else a message naming the first mismatch."""
    for key in COMPAT_KEYS:
        if local.get(key) != remote.get(key):
            msg = f"{key} mismatch: this node has {local.get(key)!r}, the peer has {remote.get(key)!r}"
            if key == "tp_size":
                msg += " (heterogeneous TP is not supported yet)"
            return msg
    return None


def pack_notif(d_request_id: str, transfer_id: str, parts: int, first_token: int | None) -> bytes:
    return msgpack.packb({"r": d_request_id, "t": transfer_id, "n": parts, "ft": first_token})


def unpack_notif(data: bytes) -> dict[str, Any] | None:
    try:
        msg = msgpack.unpackb(data)
    except Exception:
        return None
    if not isinstance(msg, dict) or "r" not in msg:
        return None
    return msg
