"""Make a program that does not bind its outgoing TCP connections send from a chosen address.

netem/uplink.sh limits each rank by the *source* address of its packets. fttree binds every
connection to its rank's address, but gloo does not: a gloo device binds its listener to the
address it is given, while the connections it initiates (gloo/transport/tcp/helpers.h,
ConnectOperation::run: socket, SO_REUSEADDR, connect, no bind) and torch's TCPStore client
get whatever source the kernel picks, which for any 127.x destination is 127.0.0.1 (rank 0's
address). Without help, the bytes gloo rank 3 sends to rank 1 would count against rank 0's
uplink.

This module builds a tiny LD_PRELOAD library that wraps connect(2): when FTTREE_BIND_ADDR is
set and an IPv4 (or IPv4-mapped IPv6) TCP socket is still unbound, it binds the socket to
that address (port 0, IP_BIND_ADDRESS_NO_PORT) before connecting. Nothing else changes.
`bound_env(addr)` is the environment a process needs; `tcp_sources()` lists the local
addresses of a process's established TCP connections, to check that it worked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..errors import ConfigError

BIND_ENV = "FTTREE_BIND_ADDR"

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

/* Bind fd to FTTREE_BIND_ADDR (port 0) if it is an unbound TCP socket headed for IPv4. */
static void bind_source(int fd, const struct sockaddr *dest) {
    const char *want = getenv("FTTREE_BIND_ADDR");
    struct in_addr a4;
    int type = 0;
    socklen_t tlen = sizeof(type);
    if (want == NULL || *want == '\0' || dest == NULL || inet_pton(AF_INET, want, &a4) != 1)
        return;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) != 0 || type != SOCK_STREAM)
        return;
    struct sockaddr_storage self;
    socklen_t slen = sizeof(self);
    memset(&self, 0, sizeof(self));
    if (getsockname(fd, (struct sockaddr *)&self, &slen) != 0)
        return;
    int one = 1, rv, err;
    if (dest->sa_family == AF_INET && self.ss_family == AF_INET) {
        struct sockaddr_in *s = (struct sockaddr_in *)&self;
        if (s->sin_port != 0 || s->sin_addr.s_addr != htonl(INADDR_ANY))
            return; /* bound by the program itself */
        struct sockaddr_in b;
        memset(&b, 0, sizeof(b));
        b.sin_family = AF_INET;
        b.sin_addr = a4;
        setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        rv = bind(fd, (struct sockaddr *)&b, sizeof(b));
    } else if (dest->sa_family == AF_INET6 && self.ss_family == AF_INET6 &&
               IN6_IS_ADDR_V4MAPPED(&((const struct sockaddr_in6 *)dest)->sin6_addr)) {
        struct sockaddr_in6 *s = (struct sockaddr_in6 *)&self;
        if (s->sin6_port != 0 || !IN6_IS_ADDR_UNSPECIFIED(&s->sin6_addr))
            return;
        struct sockaddr_in6 b;
        memset(&b, 0, sizeof(b));
        b.sin6_family = AF_INET6;
        b.sin6_addr.s6_addr[10] = 0xff;
        b.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&b.sin6_addr.s6_addr[12], &a4, 4);
        setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        rv = bind(fd, (struct sockaddr *)&b, sizeof(b));
    } else {
        return; /* a real IPv6 destination, or a socket of another family */
    }
    if (rv != 0) {
        err = errno;
        fprintf(stderr, "fttree bind shim: cannot bind a connection to %s: %s\n", want, strerror(err));
        errno = err;
    }
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static connect_fn real_connect;
    if (real_connect == NULL)
        real_connect = (connect_fn)dlsym(RTLD_NEXT, "connect");
    int saved = errno;
    bind_source(fd, addr);
    errno = saved;
    return real_connect(fd, addr, len);
}
"""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fttree"


def shim_library() -> Path:
    """The shim's shared library, compiled with the system C compiler ($CC or cc) on first use
    and kept in ~/.cache/fttree under a name that changes with its source."""
    digest = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]
    lib = cache_dir() / f"bindshim-{digest}.so"
    if lib.exists():
        return lib
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise ConfigError("binding gloo's connections to a rank address needs a C compiler to build a small "
                          "connect() wrapper (apt-get install gcc, or set CC)")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "bindshim.c", Path(tmp) / lib.name
        src.write_text(SHIM_SOURCE)
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(out), str(src), "-ldl"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ConfigError(f"building the connect() wrapper with {cc} failed:\n{done.stderr.strip()}")
        os.replace(out, lib)  # atomic: concurrent builders each install a complete file
    return lib


def bound_env(addr: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) plus what makes a child's unbound TCP
    connections leave from `addr`."""
    env = dict(os.environ if base is None else base)
    lib = str(shim_library())
    preload = [p for p in env.get("LD_PRELOAD", "").split() if p and p != lib]
    env["LD_PRELOAD"] = " ".join([lib, *preload])
    env[BIND_ENV] = addr
    return env


def shim_active(addr: str) -> bool:
    """True when this process runs with the shim loaded and binding to `addr`."""
    if os.environ.get(BIND_ENV) != addr:
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "/bindshim-" in maps


def _hex_addr(field: str) -> str:
    """The IPv4 address of a /proc/net/tcp{,6} address field (IPv4-mapped for tcp6)."""
    host = field.split(":")[0]
    if len(host) == 32:  # IPv6: four little-endian 32-bit words; the IPv4 part is the last
        host = host[24:]
    return ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))


def tcp_sources(pid: int | str = "self") -> set[str]:
    """The local IPv4 addresses (IPv4-mapped ones included) of the established TCP
    connections of process `pid`, from /proc (the process's own network namespace)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "01" and inode in inodes:  # 01: ESTABLISHED
                if table == "tcp6" and not local.startswith("0000000000000000FFFF0000"):
                    continue  # a real IPv6 connection: not ours to judge
                found.add(_hex_addr(local))
    return found
