"""Read denied-connection records from an NFLOG netlink group.

The slot chains ``log group G prefix "dsec<tag>:<slot>:<f|i>"`` every rejected packet
(rate-limited per slot in the rule itself); the kernel hands the first bytes of each
packet to the socket bound here. Parsing is pure (``parse_messages``/``parse_ipv4``);
the socket is the I/O edge. No library in our dependencies speaks NFLOG (pyroute2 has
no nfnetlink_log module), hence this small reader.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_QTHRESH = 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
_HDR = struct.Struct("=IHHII")
_COPY_BYTES = 64  # IPv4 header (<= 60) + the ports of TCP/UDP: all we record


@dataclass(frozen=True)
class LoggedPacket:
    prefix: str
    payload: bytes


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        alen, atype = struct.unpack_from("=HH", data, off)
        if alen < 4:
            break
        out[atype & 0x3FFF] = data[off + 4: off + alen]
        off += (alen + 3) & ~3
    return out


def parse_messages(buf: bytes) -> tuple[list[LoggedPacket], list[int]]:
    """Split a netlink datagram into logged packets and error codes (0 = ack)."""
    packets: list[LoggedPacket] = []
    errors: list[int] = []
    off = 0
    while off + _HDR.size <= len(buf):
        length, mtype, _flags, _seq, _pid = _HDR.unpack_from(buf, off)
        if length < _HDR.size or off + length > len(buf):
            break
        body = buf[off + _HDR.size: off + length]
        if mtype == NLMSG_ERROR and len(body) >= 4:
            errors.append(-struct.unpack_from("=i", body)[0])
        elif mtype == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET and len(body) >= 4:
            attrs = _attrs(body[4:])  # skip nfgenmsg
            prefix = attrs.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode(errors="replace")
            packets.append(LoggedPacket(prefix, attrs.get(NFULA_PAYLOAD, b"")))
        off += (length + 3) & ~3
    return packets, errors


_PROTOS = {1: "icmp", 6: "tcp", 17: "udp"}


def parse_ipv4(payload: bytes) -> tuple[str, str, int | None] | None:
    """(destination, protocol, destination port or None) of an IPv4 packet's head."""
    if len(payload) < 20 or payload[0] >> 4 != 4:
        return None
    ihl = (payload[0] & 0x0F) * 4
    proto = payload[9]
    dst = str(ipaddress.IPv4Address(payload[16:20]))
    port = None
    if proto in (6, 17) and len(payload) >= ihl + 4:
        port = struct.unpack_from("!H", payload, ihl + 2)[0]
    return dst, _PROTOS.get(proto, str(proto)), port


def _config_msg(group: int, attrs: list[tuple[int, bytes]], seq: int) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, group)
    for atype, data in attrs:
        alen = 4 + len(data)
        body += struct.pack("=HH", alen, atype) + data + b"\0" * (((alen + 3) & ~3) - alen)
    mtype = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG
    return _HDR.pack(_HDR.size + len(body), mtype, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


class NflogSocket:
    """A netlink socket bound to one NFLOG group (non-blocking after ``open``)."""

    def __init__(self, group: int) -> None:
        self.group = group
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.bind((0, 0))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            for seq, attrs in enumerate((
                [(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_BIND))],
                [(NFULA_CFG_MODE, struct.pack("!IBB", _COPY_BYTES, NFULNL_COPY_PACKET, 0)),
                 (NFULA_CFG_QTHRESH, struct.pack("!I", 1))],
            ), start=1):
                self.sock.send(_config_msg(group, attrs, seq))
                _pk, errs = parse_messages(self.sock.recv(65536))
                if errs and errs[0] != 0:
                    raise OSError(errs[0], f"NFLOG group {group}: {os.strerror(errs[0])} "
                                           "(another process bound to it? set Settings.net_nflog_group)")
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[LoggedPacket]:
        """Everything queued now (non-blocking); [] if nothing."""
        out: list[LoggedPacket] = []
        while True:
            try:
                buf = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:  # ENOBUFS: the kernel dropped records; the counters still count
                return out
            out.extend(parse_messages(buf)[0])

    def close(self) -> None:
        self.sock.close()
