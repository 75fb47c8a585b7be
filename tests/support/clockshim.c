/* An LD_PRELOAD shim for the fault test's clock faults (tests/support/faults.py Clock):
 * the wall clock (CLOCK_REALTIME, gettimeofday, time) of the process runs the number of
 * seconds in the file named by MW_CLOCK_OFFSET_FILE ahead (or behind); monotonic clocks
 * are left alone, as a real clock step leaves them. The file is read again at most every
 * 200 ms of monotonic time, with plain syscalls (no allocation in a clock call), never
 * waiting for another thread's read (it then keeps the offset it has).
 * libfaketime 0.9.10 would do this, but with monotonic clocks left alone its sleeps fail
 * with EINVAL (Python's time.sleep raises), and faking monotonic too is not a clock step. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static volatile long long offset_ns;
static long long next_read_ns;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void init(void) {
    if (!real_clock_gettime)
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
}

static long long current_offset_ns(void) {
    struct timespec now;
    init();
    real_clock_gettime(CLOCK_MONOTONIC, &now);
    long long t = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (t >= next_read_ns && pthread_mutex_trylock(&mu) == 0) {
        const char *path = getenv("MW_CLOCK_OFFSET_FILE");
        if (path) {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                char buf[64];
                ssize_t n = read(fd, buf, sizeof buf - 1);
                close(fd);
                if (n > 0) {
                    buf[n] = 0;
                    char *end;
                    double v = strtod(buf, &end);
                    if (end != buf)
                        offset_ns = (long long)(v * 1e9);
                }
            }
        }
        next_read_ns = t + 200000000LL;
        pthread_mutex_unlock(&mu);
    }
    return offset_ns;
}

static void shift(struct timespec *ts, long long ns) {
    long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + ns;
    ts->tv_sec = (time_t)(t / 1000000000LL);
    ts->tv_nsec = (long)(t % 1000000000LL);
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000L;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    init();
    int r = real_clock_gettime(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift(ts, current_offset_ns());
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (r == 0) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
