/* The sandbox side of a rollout's door (swe_grpo/sandbox/door.py): a static binary, built once on the host
 * (`swe_grpo.sandbox.door.forwarder`), copied into the door's directory and run inside the sandbox's own
 * network namespace as
 *
 *     door-forwarder PORT SOCKET [PROXY_PORT PROXY_SOCKET] -- CMD ARGS...
 *
 * It listens on 127.0.0.1:PORT (and PROXY_PORT) and pipes every connection to SOCKET (PROXY_SOCKET): unix
 * sockets on the host, bind-mounted in. Once listening it forks CMD (the agent) with this process's stdio, and
 * with HTTPS_PROXY/HTTP_PROXY set to the proxy port if there is one; it forwards SIGHUP, SIGINT, SIGQUIT,
 * SIGTERM, SIGUSR1 and SIGUSR2 to the agent and exits when the agent does, with its status (128 + the signal
 * if a signal ended it). 125: it could not start (bad arguments, a port it cannot listen on); 127: the agent
 * could not be run. No HTTP parsing here: the host side checks every request. Bytes are copied as they come,
 * end of stream included (a half-close is passed on), through a 16 KiB buffer per direction and connection:
 * one process, one epoll loop, no threads, under 1 MiB of memory.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE 16384
#define CANNOT_START 125
#define CANNOT_RUN 127

enum kind { LISTENER, SIGNALS, END };

struct listener {
    enum kind kind; /* first: what an epoll event points at */
    int fd;
    struct sockaddr_un target;
};

struct conn;

/* One side of a connection: the client (0, TCP in the sandbox) or the upstream (1, the host's unix socket). */
struct end {
    enum kind kind;
    int fd;
    unsigned events; /* what epoll watches it for; 0: not registered (nothing to wait for) */
    struct conn *conn;
};

/* Bytes read from one end and not yet written to the other; `eof`: that end sent its end of stream, `shut`:
 * the other end has been told (shutdown SHUT_WR). */
struct flow {
    char buf[BUF_SIZE];
    size_t off, len;
    int eof, shut;
};

struct conn {
    struct end ends[2];
    struct flow flows[2]; /* flows[i]: from ends[i] to ends[1 - i] */
    int closed;
    struct conn *next_closed;
    /* Not yet connected upstream (the host's backlog was full): retried until `deadline`, in arrival order. */
    struct listener *waiting_for;
    long long deadline;
    struct conn *next_waiting;
};

static int epfd;
/* Connections closed during one batch of events, freed after it: a later event of the batch may name them. */
static struct conn *closed;
static struct conn *waiting, **waiting_tail = &waiting;

#define WAIT_MS 30000 /* how long a connection waits for the host to take it before it is dropped */
#define RETRY_MS 5

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}
static const int forwarded[] = {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};

static void die(int status, const char *what, const char *detail) {
    dprintf(2, "door: %s: %s\n", what, detail);
    exit(status);
}

/* Watch `e` for `events` (registering it, changing it, or removing it when there is nothing to wait for: an
 * end with no interest must not stay registered, or a hang-up on it would wake the loop forever). */
static void watch(struct end *e, unsigned events) {
    if (events == e->events) return;
    struct epoll_event ev = {.events = events, .data.ptr = e};
    int op = !e->events ? EPOLL_CTL_ADD : !events ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    if (epoll_ctl(epfd, op, e->fd, &ev) < 0) die(CANNOT_START, "epoll_ctl", strerror(errno));
    e->events = events;
}

static void close_conn(struct conn *c) {
    for (int i = 0; i < 2; i++) {
        watch(&c->ends[i], 0);
        close(c->ends[i].fd);
    }
    c->closed = 1;
    c->next_closed = closed;
    closed = c;
}

/* Move what can be moved without blocking in both directions, then watch for what is still awaited. Returns
 * 0 if the connection was closed (an error, or both directions finished). */
static int pump(struct conn *c) {
    for (int i = 0; i < 2; i++) {
        struct flow *f = &c->flows[i];
        int from = c->ends[i].fd, to = c->ends[1 - i].fd;
        if (!f->len && !f->eof) {
            ssize_t n = read(from, f->buf, BUF_SIZE);
            if (n > 0) f->off = 0, f->len = (size_t)n;
            else if (n == 0) f->eof = 1;
            else if (errno != EAGAIN && errno != EINTR) goto fail;
        }
        while (f->len) {
            ssize_t n = send(to, f->buf + f->off, f->len, MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                goto fail;
            }
            f->off += (size_t)n, f->len -= (size_t)n;
        }
        if (f->eof && !f->len && !f->shut) {
            shutdown(to, SHUT_WR);
            f->shut = 1;
        }
    }
    if (c->flows[0].shut && c->flows[1].shut) goto end; /* both directions done */
    for (int i = 0; i < 2; i++) {
        struct flow *in = &c->flows[i], *out = &c->flows[1 - i];
        watch(&c->ends[i], (!in->len && !in->eof ? EPOLLIN : 0) | (out->len ? EPOLLOUT : 0));
    }
    return 1;
fail:
end:
    close_conn(c);
    return 0;
}

/* Connect `c` upstream: 1 connected (and pumped), 0 to retry later (the host's backlog is full: a nonblocking
 * unix connect then fails with EAGAIN and cannot be waited for), -1 failed (the connection is closed). */
static int connect_upstream(struct conn *c) {
    struct listener *l = c->waiting_for;
    if (connect(c->ends[1].fd, (struct sockaddr *)&l->target, sizeof l->target) == 0) {
        c->waiting_for = NULL;
        pump(c);
        return 1;
    }
    if (errno == EAGAIN && now_ms() < c->deadline) return 0;
    close_conn(c);
    return -1;
}

/* Retry the waiting connections in arrival order, stopping at the first the host still cannot take. */
static void retry_waiting(void) {
    while (waiting) {
        struct conn *c = waiting;
        if (connect_upstream(c) == 0) return;
        waiting = c->next_waiting;
        if (!waiting) waiting_tail = &waiting;
    }
}

static void accept_all(struct listener *l) {
    for (;;) {
        int client = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (client < 0) return; /* EAGAIN: all taken; anything else (EMFILE, ECONNABORTED): try on next wake */
        int one = 1;
        setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        int upstream = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        struct conn *c = upstream < 0 ? NULL : calloc(1, sizeof *c);
        if (!c) {
            if (upstream >= 0) close(upstream);
            close(client);
            continue;
        }
        c->ends[0] = (struct end){.kind = END, .fd = client, .conn = c};
        c->ends[1] = (struct end){.kind = END, .fd = upstream, .conn = c};
        c->waiting_for = l;
        c->deadline = now_ms() + WAIT_MS;
        if (waiting || connect_upstream(c) == 0) { /* behind others, or the host's backlog is full: wait */
            *waiting_tail = c;
            waiting_tail = &c->next_waiting;
        }
    }
}

static void listen_on(struct listener *l, const char *port, const char *path) {
    char *rest;
    long number = strtol(port, &rest, 10);
    if (!*port || *rest || number < 1 || number > 65535) die(CANNOT_START, "not a port", port);
    if (strlen(path) >= sizeof l->target.sun_path) die(CANNOT_START, "socket path too long", path);
    l->kind = LISTENER;
    l->target.sun_family = AF_UNIX;
    strcpy(l->target.sun_path, path);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)number)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    l->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l->fd < 0 || setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(l->fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(l->fd, SOMAXCONN) < 0) {
        char where[64];
        snprintf(where, sizeof where, "cannot listen on 127.0.0.1:%s", port);
        die(CANNOT_START, where, strerror(errno));
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = l};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, l->fd, &ev) < 0) die(CANNOT_START, "epoll_ctl", strerror(errno));
}

/* Fork and exec the agent with the signal state this process started with; exits 127 if it cannot run. */
static pid_t start_agent(char **argv, const sigset_t *original) {
    int report[2];
    if (pipe2(report, O_CLOEXEC) < 0) die(CANNOT_RUN, "pipe", strerror(errno));
    pid_t pid = fork();
    if (pid < 0) die(CANNOT_RUN, "fork", strerror(errno));
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL);
        sigprocmask(SIG_SETMASK, original, NULL);
        execvp(argv[0], argv);
        int err = errno;
        (void)!write(report[1], &err, sizeof err);
        _exit(CANNOT_RUN);
    }
    close(report[1]);
    int err;
    ssize_t n;
    while ((n = read(report[0], &err, sizeof err)) < 0 && errno == EINTR) {
    }
    close(report[0]);
    if (n == (ssize_t)sizeof err) {
        char what[512];
        snprintf(what, sizeof what, "cannot run %s", argv[0]);
        die(CANNOT_RUN, what, strerror(err));
    }
    return pid;
}

int main(int argc, char **argv) {
    int split = 1;
    while (split < argc && strcmp(argv[split], "--")) split++;
    if ((split != 3 && split != 5) || split + 1 >= argc)
        die(CANNOT_START, "usage", "door-forwarder PORT SOCKET [PROXY_PORT PROXY_SOCKET] -- CMD ARGS...");

    /* Signals arrive through a signalfd; the agent gets the mask and dispositions this process started with. */
    sigset_t handled, original;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaddset(&handled, forwarded[i]);
    sigprocmask(SIG_BLOCK, &handled, &original);
    signal(SIGPIPE, SIG_IGN);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) die(CANNOT_START, "epoll_create1", strerror(errno));
    struct end signals = {.kind = SIGNALS, .fd = signalfd(-1, &handled, SFD_NONBLOCK | SFD_CLOEXEC)};
    if (signals.fd < 0) die(CANNOT_START, "signalfd", strerror(errno));
    watch(&signals, EPOLLIN);

    static struct listener door, proxy;
    listen_on(&door, argv[1], argv[2]);
    if (split == 5) {
        listen_on(&proxy, argv[3], argv[4]);
        char url[64];
        snprintf(url, sizeof url, "http://127.0.0.1:%s", argv[3]);
        const char *names[] = {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"};
        for (size_t i = 0; i < 4; i++) setenv(names[i], url, 1);
        setenv("NO_PROXY", "127.0.0.1,localhost", 1);
        setenv("no_proxy", "127.0.0.1,localhost", 1);
    }
    pid_t agent = start_agent(argv + split + 1, &original);

    for (;;) {
        struct epoll_event events[64];
        int n = epoll_wait(epfd, events, 64, waiting ? RETRY_MS : -1);
        if (n < 0 && errno != EINTR) die(CANNOT_START, "epoll_wait", strerror(errno));
        for (int i = 0; i < n; i++) {
            enum kind *kind = events[i].data.ptr;
            if (*kind == LISTENER) {
                accept_all((struct listener *)kind);
            } else if (*kind == END) {
                struct conn *c = ((struct end *)kind)->conn;
                if (!c->closed) pump(c);
            } else {
                struct signalfd_siginfo info;
                while (read(signals.fd, &info, sizeof info) == (ssize_t)sizeof info) {
                    if (info.ssi_signo != SIGCHLD) {
                        kill(agent, (int)info.ssi_signo);
                        continue;
                    }
                    int status;
                    pid_t pid;
                    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) /* orphans too, when this is pid 1 */
                        if (pid == agent) exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
                }
            }
        }
        retry_waiting();
        while (closed) {
            struct conn *c = closed;
            closed = c->next_closed;
            free(c);
        }
    }
}
