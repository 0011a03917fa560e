/* seccomp-exec: run a command under a seccomp filter; every exec of a `docker` sandbox starts with it
 * (swe_grpo/sandbox/docker/seccomp.py).
 *
 *     seccomp-exec FILTER COMMAND [ARG...]
 *
 * FILTER is a file holding a classic BPF program: `struct sock_filter` records, as
 * swe_grpo.sandbox.local.seccomp.program() writes them. It is installed on top of the filter the process
 * already has (the engine's profile: filters stack, and the kernel applies the strictest answer of all),
 * then COMMAND replaces this process (execvp: PATH is searched), so the filter holds for it and for
 * everything it starts, and none of them can remove it. no_new_privs is set first, as the kernel requires
 * of an unprivileged process (the container already has it).
 *
 * When COMMAND never runs, a message goes to stderr and the exit status is the shell's: 127 when it is
 * not found, 126 when it cannot be run or the filter cannot be read or installed. */
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

/* The most instructions the kernel accepts in one program (BPF_MAXINSNS). */
#define MAX_RECORDS 4096

static struct sock_filter records[MAX_RECORDS + 1]; /* one more: a longer file is refused, not cut */

static int fail(int status, const char *what, const char *path, int error) {
    fprintf(stderr, "seccomp-exec: %s %s: %s\n", what, path, strerror(error));
    return status;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: seccomp-exec FILTER COMMAND [ARG...]\n");
        return 126;
    }
    int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail(126, "cannot open the filter", argv[1], errno);
    char *buffer = (char *)records;
    size_t size = 0;
    ssize_t got;
    while (size < sizeof records && (got = read(fd, buffer + size, sizeof records - size)) != 0) {
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return fail(126, "cannot read the filter", argv[1], errno);
        }
        size += (size_t)got;
    }
    close(fd);
    if (size == 0 || size == sizeof records || size % sizeof records[0] != 0)
        return fail(126, "not a filter program:", argv[1], EINVAL);
    struct sock_fprog program = {.len = (unsigned short)(size / sizeof records[0]), .filter = records};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return fail(126, "cannot set no_new_privs for", argv[2], errno);
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0)
        return fail(126, "cannot install the filter", argv[1], errno);
    execvp(argv[2], argv + 2);
    return fail(errno == ENOENT ? 127 : 126, "cannot run", argv[2], errno);
}
