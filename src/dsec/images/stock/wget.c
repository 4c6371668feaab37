/* wget for the stock busybox image: a small static HTTP/1.0 client.
 *
 * Why: Debian's busybox-static wget segfaults as soon as a timeout is set (`wget -T 2`,
 * on the host too) and has no TLS helper, so the first allow-list try of a new user
 * looked like a DSec bug. This one does what the examples need and fails with a clear
 * message otherwise.
 *
 *   wget [-q] [-S] [-O FILE|-] [-T SECONDS] http://HOST[:PORT][/PATH]
 *
 * Exit 0 on a 2xx answer (body written), 1 otherwise (message on stderr). Redirects
 * (3xx with an http:// Location) are followed up to 5 times. https:// is refused with
 * a pointer to the python image (no TLS library in a static busybox image).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

static int quiet, show_headers;
static int timeout_ms = -1; /* -1: wait forever (busybox's default is 15 min) */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("wget: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

struct url { char host[256]; char port[8]; char path[4096]; };

static void parse_url(const char *u, struct url *out) {
    if (strncasecmp(u, "https://", 8) == 0)
        die("https:// is not supported by this image's wget (no TLS in the busybox image); "
            "use the python image: python3 -c \"import urllib.request; ...\"");
    if (strncasecmp(u, "http://", 7) == 0) u += 7;
    else if (strstr(u, "://")) die("unsupported URL scheme in '%s' (only http://)", u);
    const char *slash = strchr(u, '/');
    size_t hl = slash ? (size_t)(slash - u) : strlen(u);
    if (hl == 0 || hl >= sizeof out->host) die("bad URL '%s'", u);
    char hostport[256];
    memcpy(hostport, u, hl);
    hostport[hl] = 0;
    snprintf(out->path, sizeof out->path, "%s", slash ? slash : "/");
    strcpy(out->port, "80");
    char *colon = NULL;
    if (hostport[0] == '[') { /* [v6]:port */
        char *end = strchr(hostport, ']');
        if (!end) die("bad address '%s'", hostport);
        *end = 0;
        snprintf(out->host, sizeof out->host, "%s", hostport + 1);
        if (end[1] == ':') colon = end + 1;
    } else {
        colon = strrchr(hostport, ':');
        if (colon) *colon = 0;
        snprintf(out->host, sizeof out->host, "%s", hostport);
    }
    if (colon && colon[1]) {
        if (strlen(colon + 1) >= sizeof out->port) die("bad port in '%s'", u);
        snprintf(out->port, sizeof out->port, "%s", colon + 1);
    }
}

static int wait_fd(int fd, short ev) {
    struct pollfd p = {.fd = fd, .events = ev};
    int r;
    do r = poll(&p, 1, timeout_ms); while (r < 0 && errno == EINTR);
    return r;
}

static int dial(const struct url *u) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res, *ai;
    int rc = getaddrinfo(u->host, u->port, &hints, &res);
    if (rc != 0) die("bad address '%s': %s", u->host, gai_strerror(rc));
    int last = 0;
    for (ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) { last = errno; continue; }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS) {
            int w = wait_fd(fd, POLLOUT), err = 0;
            socklen_t len = sizeof err;
            if (w == 0) { close(fd); freeaddrinfo(res); die("connecting to %s:%s timed out", u->host, u->port); }
            if (w > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
                freeaddrinfo(res);
                return fd;
            }
            last = err ? err : errno;
        } else {
            last = errno;
        }
        close(fd);
    }
    freeaddrinfo(res);
    die("can't connect to remote host %s:%s: %s", u->host, u->port, strerror(last));
    return -1;
}

static ssize_t read_some(int fd, char *buf, size_t n) {
    int w = wait_fd(fd, POLLIN);
    if (w == 0) die("download timed out");
    ssize_t r;
    do r = read(fd, buf, n); while (r < 0 && errno == EINTR);
    if (r < 0) die("read error: %s", strerror(errno));
    return r;
}

static void write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) { /* the socket is non-blocking */
            if (wait_fd(fd, POLLOUT) == 0) die("write timed out");
            continue;
        }
        if (w < 0) die("write error: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
}

int main(int argc, char **argv) {
    const char *out_name = NULL;
    int opt;
    int kept = 1; /* --timeout=N and --quiet, as GNU/busybox wget spell them: consumed here */
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--timeout=", 10) == 0) timeout_ms = atoi(argv[i] + 10) > 0 ? atoi(argv[i] + 10) * 1000 : -1;
        else if (strcmp(argv[i], "--quiet") == 0) quiet = 1;
        else argv[kept++] = argv[i];
    }
    argc = kept;
    while ((opt = getopt(argc, argv, "qSO:T:")) != -1) {
        switch (opt) {
        case 'q': quiet = 1; break;
        case 'S': show_headers = 1; break;
        case 'O': out_name = optarg; break;
        case 'T': timeout_ms = atoi(optarg) > 0 ? atoi(optarg) * 1000 : -1; break;
        default: die("usage: wget [-q] [-S] [-O FILE|-] [-T SECONDS] http://HOST[:PORT][/PATH]");
        }
    }
    if (optind != argc - 1) die("usage: wget [-q] [-S] [-O FILE|-] [-T SECONDS] http://HOST[:PORT][/PATH]");
    char urlbuf[4400];
    snprintf(urlbuf, sizeof urlbuf, "%s", argv[optind]);
    for (int hop = 0; hop < 6; hop++) {
        struct url u;
        parse_url(urlbuf, &u);
        if (!quiet) fprintf(stderr, "Connecting to %s:%s\n", u.host, u.port);
        int fd = dial(&u);
        char req[4800];
        int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: %s%s%s\r\nUser-Agent: dsec-wget\r\n"
                         "Accept: */*\r\nConnection: close\r\n\r\n", u.path, u.host,
                         strcmp(u.port, "80") ? ":" : "", strcmp(u.port, "80") ? u.port : "");
        write_all(fd, req, (size_t)n);
        static char head[65536];
        size_t have = 0;
        char *end = NULL;
        while (!end) {
            if (have == sizeof head - 1) die("response headers too large");
            ssize_t r = read_some(fd, head + have, sizeof head - 1 - have);
            if (r == 0) die("server closed the connection before a full response");
            have += (size_t)r;
            head[have] = 0;
            end = strstr(head, "\r\n\r\n");
        }
        size_t hlen = (size_t)(end - head) + 4;
        int status = 0;
        if (sscanf(head, "HTTP/%*d.%*d %d", &status) != 1) die("not an HTTP answer");
        if (show_headers) fwrite(head, 1, hlen, stderr);
        if (status >= 300 && status < 400 && hop < 5) {
            char *loc = strcasestr(head, "\r\nLocation:");
            if (loc && loc < end) {
                loc += 11;
                while (*loc == ' ') loc++;
                size_t l = strcspn(loc, "\r\n");
                if (loc[0] == '/') snprintf(urlbuf, sizeof urlbuf, "http://%s:%s%.*s", u.host, u.port, (int)l, loc);
                else snprintf(urlbuf, sizeof urlbuf, "%.*s", (int)l, loc);
                close(fd);
                continue;
            }
        }
        if (status < 200 || status >= 300) {
            char *eol = strstr(head, "\r\n");
            die("server returned error: %.*s", (int)(eol - head), head);
        }
        const char *name = out_name;
        if (!name) {
            const char *b = strrchr(u.path, '/');
            name = (b && b[1]) ? b + 1 : "index.html";
        }
        int ofd = strcmp(name, "-") == 0 ? 1 : open(name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (ofd < 0) die("can't open '%s': %s", name, strerror(errno));
        if (!quiet && ofd != 1) fprintf(stderr, "saving to '%s'\n", name);
        write_all(ofd, head + hlen, have - hlen);
        char buf[65536];
        ssize_t r;
        while ((r = read_some(fd, buf, sizeof buf)) > 0) write_all(ofd, buf, (size_t)r);
        close(fd);
        if (ofd != 1 && close(ofd) != 0) die("write error: %s", strerror(errno));
        return 0;
    }
    die("too many redirects");
    return 1;
}
