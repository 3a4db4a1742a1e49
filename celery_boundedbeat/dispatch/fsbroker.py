"""Whole message files for kombu's filesystem transport (the broker that needs no server).

kombu creates a message file and then writes into it; a worker polling the folder can take the
file in between and read nothing, and ``json.loads("")`` stops that worker (``Unrecoverable
error: JSONDecodeError``). The integration suite hit it twice in one run. A process that
publishes runs (the beat's dispatcher, ``boundedbeat dispatch``) therefore writes each message
under a name no reader looks at and renames it into place, which is atomic on one filesystem.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

_MARK = "_boundedbeat_whole_files"


def use_whole_files(broker_url: str | None) -> bool:
    """Make the filesystem transport's writes atomic in this process; whether it applied."""
    if not (broker_url or "").startswith("filesystem:"):
        return False
    from kombu.exceptions import ChannelError
    from kombu.transport import filesystem
    from kombu.utils.encoding import str_to_bytes
    from kombu.utils.json import dumps

    channel: Any = filesystem.Channel
    if getattr(channel._put, _MARK, False):
        return True

    def _put(self: Any, queue: str, payload: Any, **_: Any) -> None:
        # The transport's own name (its readers order by it and match the queue's suffix).
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        hidden = os.path.join(self.data_folder_out, f".{uuid.uuid4().hex}.writing")
        try:
            with open(hidden, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))  # type: ignore[no-untyped-call]
            os.replace(hidden, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    setattr(_put, _MARK, True)
    channel._put = _put
    return True
