"""Tiny test servers run inside the test's "remote host" namespaces (and on the host).

    servers.py tcp ADDR PORT...        answer "ok" and close
    servers.py hold ADDR PORT          answer "held", keep the connection open 4 s
    servers.py udplog ADDR PORT FILE   append "src_ip payload" of every datagram to FILE
"""

import socket
import sys
import threading
import time


def tcp(addr: str, port: int, reply: bytes, hold: float) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(128)

    def serve(c: socket.socket) -> None:
        try:
            c.sendall(reply)
            time.sleep(hold)
        finally:
            c.close()

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def udplog(addr: str, port: int, path: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, port))
    while True:
        data, (src, _) = s.recvfrom(2048)
        with open(path, "a") as fh:
            fh.write(f"{src} {data.decode(errors='replace')}\n")


def main() -> None:
    kind, addr, *rest = sys.argv[1:]
    if kind == "udplog":
        udplog(addr, int(rest[0]), rest[1])
        return
    reply, hold = (b"ok\n", 0.0) if kind == "tcp" else (b"held\n", 4.0)
    threads = [threading.Thread(target=tcp, args=(addr, int(p), reply, hold), daemon=True) for p in rest]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
