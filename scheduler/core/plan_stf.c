/*
 * mlfabric.scheduler.core._plan_native.stf_run: stf_planner.Planner.run in C (issue 24).
 *
 * The same lazy-heap STF loop as the Python (classes, gate groups, exact entries verified by
 * still_exact, preemptive tau_max drops), over the planner's state as it stands when run()
 * is called, with the same arithmetic in the same order and the same heap keys and ties
 * (update ids compared as Python compares str), so the plan is the same to the last bit
 * (tests/scheduler/test_plan_native.py runs both). Timelines are read in place (their
 * Python lists); a link the Timelines has no timeline for yet reads as its graph capacity
 * until a transfer reserves it (then Timelines.link makes it, as the Python walk would
 * have). Reservations are Timelines.reserve's (fast_transfer, or the method itself where
 * that returns None). Drops go into the planner's `drops` dict in the Python's order; the
 * planned transfers are returned. The planner's own Python state is not updated: run once.
 *
 * Returns None, having changed nothing, where the inputs are not as the C expects (a time
 * that is not a float, a member that is not (float, str)): the Python loop runs then.
 */
#include "plan_stf.h"

PyObject *s_capacity;
PyObject *s_ready_at, *s_base_version, *s_dst, *s_bytes, *s_path_tag, *s_get, *s_rates, *s_reserve, *s_who;

/* ------------------------------------------------------------------ order and heaps */

static inline int ucmp(const STF *st, Py_ssize_t a, Py_ssize_t b) {
    if (a == b) return 0;
    return PyUnicode_Compare(st->u[a].uid, st->u[b].uid); /* exact str: no error */
}

static inline int m_less(const STF *st, const MEntry *a, const MEntry *b) {
    if (a->key != b->key) return a->key < b->key;
    if (a->nbytes != b->nbytes) return a->nbytes < b->nbytes;
    int c = ucmp(st, a->uid, b->uid);
    if (c) return c < 0;
    return a->seq < b->seq;
}

static inline int g_less(const STF *st, const GEntry *a, const GEntry *b) {
    if (a->d != b->d) return a->d < b->d;
    if (a->nbytes != b->nbytes) return a->nbytes < b->nbytes;
    int c = ucmp(st, a->uid, b->uid);
    if (c) return c < 0;
    return a->cls < b->cls;
}

#define HEAP_FUNCS(NAME, T, LESS)                                                                                      \
    static void NAME##_up(const STF *st, T *h, Py_ssize_t i) {                                                         \
        T e = h[i];                                                                                                    \
        while (i > 0) {                                                                                                \
            Py_ssize_t up = (i - 1) / 2;                                                                               \
            if (!LESS(st, &e, &h[up])) break;                                                                          \
            h[i] = h[up];                                                                                              \
            i = up;                                                                                                    \
        }                                                                                                              \
        h[i] = e;                                                                                                      \
    }                                                                                                                  \
    static void NAME##_pop(const STF *st, T *h, Py_ssize_t *n) {                                                       \
        T e = h[--(*n)];                                                                                               \
        Py_ssize_t i = 0, size = *n;                                                                                   \
        if (size == 0) return;                                                                                         \
        for (;;) {                                                                                                     \
            Py_ssize_t c = 2 * i + 1;                                                                                  \
            if (c >= size) break;                                                                                      \
            if (c + 1 < size && LESS(st, &h[c + 1], &h[c])) c++;                                                       \
            if (!LESS(st, &h[c], &e)) break;                                                                           \
            h[i] = h[c];                                                                                               \
            i = c;                                                                                                     \
        }                                                                                                              \
        h[i] = e;                                                                                                      \
    }

HEAP_FUNCS(mheap, MEntry, m_less)
HEAP_FUNCS(gheap, GEntry, g_less)

static int mpush(STF *st, MEntry e) {
    if (stf_grow((void **)&st->heap, &st->hcap, st->nh + 1, sizeof(MEntry)) < 0) return -1;
    st->heap[st->nh] = e;
    mheap_up(st, st->heap, st->nh++);
    return 0;
}

static int gpush(STF *st, Py_ssize_t li, GEntry e) {
    Lnk *l = &st->l[li];
    if (stf_grow((void **)&l->g, &l->gcap, l->gn + 1, sizeof(GEntry)) < 0) return -1;
    l->g[l->gn] = e;
    gheap_up(st, l->g, l->gn++);
    return 0;
}

static void gpop(STF *st, Py_ssize_t li) { gheap_pop(st, st->l[li].g, &st->l[li].gn); }

/* ------------------------------------------------------------------ updates and classes */

Py_ssize_t stf_new_class(STF *st, PyObject *start_o) {
    double start = PyFloat_AsDouble(start_o);
    if (start == -1.0 && PyErr_Occurred()) return -1;
    if (stf_grow((void **)&st->c, &st->ccap, st->nc + 1, sizeof(Cls)) < 0) return -1;
    Cls *c = &st->c[st->nc];
    memset(c, 0, sizeof(*c));
    Py_INCREF(start_o);
    c->start_o = start_o;
    c->start = start;
    c->gate = -1;
    return st->nc++;
}

int stf_class_append(Cls *c, Py_ssize_t ui) {
    if (stf_grow((void **)&c->m, &c->cap, c->n + 1, sizeof(Py_ssize_t)) < 0) return -1;
    c->m[c->n++] = ui;
    return 0;
}

/* UpdateClass.current: the head member still in class ci, -1: none, -2: error (members
   listed but not taken yet are taken as the head reaches them) */
static Py_ssize_t current(STF *st, Py_ssize_t ci) {
    for (;;) {
        Cls *c = &st->c[ci];
        Py_ssize_t h = c->head, n = c->n;
        while (h < n) {
            Upd *u = &st->u[c->m[h]];
            if (!u->gone && u->cls == ci) {
                c->head = h;
                return c->m[h];
            }
            h++;
        }
        c->head = h;
        if (c->pm == NULL || c->pq >= c->pn) return -1;
        if (stf_take(st, ci) < 0) return -2;
    }
}

/* the index of `uid` (made with `nbytes` on first sight), -1 on error; *fresh: made now */
Py_ssize_t stf_uid_index(STF *st, PyObject *uid, double nbytes, int *fresh) {
    PyObject *ix = PyDict_GetItemWithError(st->uid_ix, uid);
    *fresh = 0;
    if (ix != NULL) return PyLong_AsSsize_t(ix);
    if (PyErr_Occurred()) return -1;
    if (stf_grow((void **)&st->u, &st->ucap, st->nu + 1, sizeof(Upd)) < 0) return -1;
    PyObject *v = PyLong_FromSsize_t(st->nu);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(st->uid_ix, uid, v);
    Py_DECREF(v);
    if (rc < 0) return -1;
    Upd *u = &st->u[st->nu];
    Py_INCREF(uid);
    u->uid = uid;
    u->nbytes = nbytes;
    u->cls = -1;
    u->gone = 0;
    u->nl = -1;
    u->l0 = 0;
    u->links = NULL;
    u->row = NULL;
    *fresh = 1;
    return st->nu++;
}

/* Planner.add(uid, exact=True): into the class of its full path from max(ready_at, now) */
Py_ssize_t stf_add_exact(STF *st, Py_ssize_t ui) {
    PyObject *uid = st->u[ui].uid;
    PyObject *uo = PyDict_GetItemWithError(st->by_id, uid);
    PyObject *links = uo ? PyDict_GetItemWithError(st->links_of, uid) : NULL;
    if (links == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, uid);
        return -1;
    }
    PyObject *ready = PyObject_GetAttr(uo, s_ready_at);
    if (ready == NULL) return -1;
    int later = PyObject_RichCompareBool(st->now_o, ready, Py_GT);
    if (later < 0) {
        Py_DECREF(ready);
        return -1;
    }
    PyObject *start_o = later ? st->now_o : ready; /* max(ready_at, now) */
    PyObject *key = PyTuple_Pack(3, s_path_tag, start_o, links);
    Py_ssize_t ci = -1;
    if (key == NULL) goto done;
    PyObject *ix = PyDict_GetItemWithError(st->class_of_key, key);
    if (ix != NULL) {
        ci = PyLong_AsSsize_t(ix);
    } else if (!PyErr_Occurred()) {
        ci = stf_new_class(st, start_o);
        PyObject *v = ci >= 0 ? PyLong_FromSsize_t(ci) : NULL;
        if (v == NULL || PyDict_SetItem(st->class_of_key, key, v) < 0) ci = -1;
        Py_XDECREF(v);
    }
    if (ci < 0) goto done;
    if (stf_take_all(st, ci) < 0) { /* (the members listed after the head: insort among all) */
        ci = -1;
        goto done;
    }
    Cls *c = &st->c[ci]; /* insort((nbytes, uid), lo=head) */
    Py_ssize_t lo = c->head, hi = c->n;
    double nb = st->u[ui].nbytes;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        Upd *o = &st->u[c->m[mid]];
        int less = nb != o->nbytes ? nb < o->nbytes : ucmp(st, ui, c->m[mid]) < 0;
        if (less)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (stf_class_append(c, ui) < 0) {
        ci = -1;
        goto done;
    }
    memmove(c->m + lo + 1, c->m + lo, (size_t)(c->n - 1 - lo) * sizeof(Py_ssize_t));
    c->m[lo] = ui;
    st->u[ui].cls = ci;
done:
    Py_XDECREF(key);
    Py_DECREF(ready);
    return ci;
}

/* ------------------------------------------------------------------ ten and its bounds */

/* Planner.ten: 1 (*end; the head's rates remembered), 0: never has residual bandwidth, -1 */
static int ten(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes, double *end) {
    int r = stf_walk(st, ui, nbytes, st->c[ci].start, end);
    if (r != 1) return r;
    Cls *c = &st->c[ci];
    if (stf_grow((void **)&c->ex_p, &c->ex_cap, 3 * st->nscratch, sizeof(double)) < 0) return -1;
    memcpy(c->ex_p, st->scratch, (size_t)(3 * st->nscratch) * sizeof(double));
    c->ex_n = st->nscratch;
    c->ex_ok = 1;
    c->ex_uid = ui;
    c->ex_stamp = st->stamp;
    c->ex_end = *end;
    return 1;
}

/* Planner.still_exact: 1 (*end), 0: recompute, -1: error */
static int still_exact(STF *st, Py_ssize_t ci, Py_ssize_t ui, double *end) {
    Cls *c = &st->c[ci];
    if (!c->ex_ok || c->ex_uid != ui) return 0;
    Py_ssize_t nl;
    Py_ssize_t *lk = stf_links_of(st, ui, &nl);
    if (lk == NULL) return -1;
    for (Py_ssize_t k = 0; k < nl; k++) {
        if (st->l[lk[k]].modified > c->ex_stamp) {
            for (Py_ssize_t q = 0; q < c->ex_n; q++) {
                double *p = c->ex_p + 3 * q;
                if (stf_min_over(st, lk[k], p[0], p[1]) < p[2]) return 0;
            }
        }
    }
    *end = c->ex_end;
    return 1;
}

/* the drop of an update whose path never has residual bandwidth, with the Python's words */
static int drop_no_residual(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes) {
    if (stf_flush(st) < 0) return -1; /* the Python reads the Timelines */
    PyObject *nb = PyFloat_FromDouble(nbytes);
    if (nb == NULL) return -1;
    PyObject *got = PyObject_CallMethodObjArgs(st->tls, s_rates, st->u[ui].links, nb, st->c[ci].start_o, NULL);
    Py_DECREF(nb);
    if (got != NULL) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_SystemError, "stf_run: a walk that failed in C succeeded in Python");
        return -1;
    }
    if (!PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    PyObject *reason = exc ? PyUnicode_FromFormat("no residual bandwidth: %S", exc) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
    if (reason == NULL) return -1;
    int rc = PyDict_SetItem(st->drops, st->u[ui].uid, reason);
    Py_DECREF(reason);
    return rc;
}

/* Planner.push_exact without its place(): 0 pushed, 1 dropped, -1 error */
static int push_exact(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes) {
    st->c[ci].gate = -1;
    double end;
    int r = ten(st, ci, ui, nbytes, &end);
    if (r < 0) return -1;
    if (r == 0) {
        st->u[ui].gone = 1;
        return drop_no_residual(st, ci, ui, nbytes) < 0 ? -1 : 1;
    }
    return mpush(st, (MEntry){end, nbytes, ui, st->seq++, K_EXACT, ci});
}

/* Planner.group_top: 1 (*top), 0: the group is empty, -1: error */
static int group_top(STF *st, Py_ssize_t gate, GEntry *top) {
    while (st->l[gate].gn > 0) {
        GEntry t = st->l[gate].g[0];
        if (st->c[t.cls].gate == gate) {
            Py_ssize_t h = current(st, t.cls);
            if (h == -2) return -1;
            if (h == t.uid) {
                *top = t;
                return 1;
            }
        }
        gpop(st, gate);
    }
    return 0;
}

/* Planner.push_group: (re)key the one live heap entry of gate's group */
static int push_group(STF *st, Py_ssize_t gate) {
    GEntry top;
    int found = group_top(st, gate, &top);
    if (found <= 0) {
        st->l[gate].live = -1;
        return found;
    }
    double key = stf_free_from(st, gate) + top.d;
    Lnk *g = &st->l[gate];
    if (g->live >= 0 && g->has_key && g->k_key == key && g->k_nbytes == top.nbytes && g->k_uid == top.uid) return 0;
    Py_ssize_t seq = st->seq++;
    g->live = seq;
    g->has_key = 1;
    g->k_key = key;
    g->k_nbytes = top.nbytes;
    g->k_uid = top.uid;
    return mpush(st, (MEntry){key, top.nbytes, top.uid, seq, K_GROUP, gate});
}

/* Planner.place: queue class ci's head in its gate's group, or as an exact entry */
int stf_place(STF *st, Py_ssize_t ci) {
    for (;;) {
        Py_ssize_t h = current(st, ci);
        st->c[ci].gate = -1;
        if (h < 0) return h == -2 ? -1 : 0;
        Py_ssize_t nl;
        Py_ssize_t *lk = stf_links_of(st, h, &nl);
        if (lk == NULL) return -1;
        double nbytes = st->u[h].nbytes, free = st->c[ci].start;
        Py_ssize_t gate = -1;
        for (Py_ssize_t k = 0; k < nl; k++) {
            double f = stf_free_from(st, lk[k]);
            if (f > free) {
                gate = lk[k];
                free = f;
            }
        }
        if (gate < 0 || free == INFINITY) {
            int r = push_exact(st, ci, h, nbytes);
            if (r == 1) continue; /* dropped: the next member */
            return r;
        }
        double low = INFINITY;
        for (Py_ssize_t k = 0; k < nl; k++) {
            double p = stf_peak(st, lk[k]);
            if (p < low) low = p;
        }
        st->c[ci].gate = gate;
        if (gpush(st, gate, (GEntry){nbytes / low, nbytes, h, ci}) < 0) return -1;
        return push_group(st, gate);
    }
}

static int push_exact_or_place(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes) {
    int r = push_exact(st, ci, ui, nbytes);
    return r == 1 ? stf_place(st, ci) : r;
}

/* ------------------------------------------------------------------ Planner.run */

int stf_loop(STF *st, Py_ssize_t limit) {
    Py_ssize_t nc0 = st->nc;
    for (Py_ssize_t ci = 0; ci < nc0; ci++)
        if (stf_place(st, ci) < 0) return -1;
    while (st->nh > 0 && (limit < 0 || PyList_GET_SIZE(st->transfers) < limit)) {
        MEntry e = st->heap[0];
        mheap_pop(st, st->heap, &st->nh);
        double end;
        if (e.kind == K_EXACT) {
            Py_ssize_t ci = e.ref;
            Py_ssize_t h = current(st, ci);
            if (h == -2) return -1;
            if (h != e.uid || st->c[ci].gate >= 0) continue;
            int ok = still_exact(st, ci, e.uid, &end);
            if (ok < 0) return -1;
            if ((ok && end == e.key ? stf_accept(st, ci, e.uid, e.nbytes) : stf_place(st, ci)) < 0) return -1;
            continue;
        }
        Py_ssize_t gate = e.ref;
        if (st->l[gate].live != e.seq) continue; /* superseded by a newer entry of the same group */
        st->l[gate].live = -1;
        GEntry top;
        int found = group_top(st, gate, &top);
        if (found < 0) return -1;
        if (!found) continue;
        double free = stf_free_from(st, gate);
        if (free + top.d != e.key || top.uid != e.uid) {
            if (push_group(st, gate) < 0) return -1;
            continue;
        }
        Py_ssize_t nl;
        Py_ssize_t *lk = stf_links_of(st, top.uid, &nl);
        if (lk == NULL) return -1;
        int moved = 0;
        for (Py_ssize_t k = 0; k < nl && !moved; k++) moved = stf_free_from(st, lk[k]) > free;
        if (moved) { /* another link now gates it */
            gpop(st, gate);
            if (stf_place(st, top.cls) < 0 || push_group(st, gate) < 0) return -1;
            continue;
        }
        int ok = still_exact(st, top.cls, top.uid, &end);
        if (ok < 0) return -1;
        if (!ok) {
            int r = ten(st, top.cls, top.uid, top.nbytes, &end);
            if (r < 0) return -1;
            if (r == 0) {
                gpop(st, gate);
                if (push_exact_or_place(st, top.cls, top.uid, top.nbytes) < 0 || push_group(st, gate) < 0) return -1;
                continue;
            }
        }
        gpop(st, gate);
        if (push_group(st, gate) < 0) return -1;
        const MEntry *next = st->nh ? &st->heap[0] : NULL;
        int first = next == NULL;
        if (!first) { /* (end, nbytes, uid) <= heap[0][:3] */
            if (end != next->key)
                first = end < next->key;
            else if (top.nbytes != next->nbytes)
                first = top.nbytes < next->nbytes;
            else
                first = ucmp(st, top.uid, next->uid) <= 0;
        }
        if (first) {
            if (stf_accept(st, top.cls, top.uid, top.nbytes) < 0) return -1;
        } else if (end == e.key) { /* its bound is exact: back in the group */
            if (gpush(st, gate, top) < 0 || push_group(st, gate) < 0) return -1;
        } else {
            st->c[top.cls].gate = -1;
            if (mpush(st, (MEntry){end, top.nbytes, top.uid, st->seq++, K_EXACT, top.cls}) < 0) return -1;
        }
    }
    return 0;
}
