/*
 * mlfabric.scheduler.core._plan_native: the tree planner's per-update loops in C (issue 24).
 *
 * Each function runs the same arithmetic, in the same order, on the same Python objects as
 * the Python it stands in for (which stays, and runs where this module is not built), so a
 * plan is the same to the last bit: built with -ffp-contract=off (no fused multiply-add),
 * heaps ordered by the same keys and ties, dicts filled in the same order.
 *
 *   transfer(timelines, links, nbytes, ready, who, Reservation) -> (start, end, reservations) | None
 *       Timelines.transfer's walk and reservation: integrate the path residual of `links`
 *       from `ready` until `nbytes` are through (Timelines._walk, record=True), then
 *       subtract each piece's rate on every link (LinkTimeline.reserve, link by link) and
 *       return the Reservation tuples. `timelines` is Timelines._links (link ->
 *       LinkTimeline). None, with nothing changed, where a link has no timeline yet, a time
 *       is not a float, or the path never has residual bandwidth: the caller makes the
 *       timelines, or runs the Python loops (which raise). A reservation beyond the residual
 *       raises ValueError as LinkTimeline.reserve does.
 *
 *   reserve_tree(timelines, routes, order, nodes, parent, server, size, readies, now,
 *                Transfer, Reservation, fields) -> (transfers, makespan)
 *       tree_cost.reserve's loop: every payload of a tree reserved on the Timelines (the
 *       updates in `order`, each aggregate once its members are reserved), along
 *       routes.tree_path; each Transfer made with its `fields` filled in order (or by calling
 *       the class where `fields` is None).
 *
 *   estimate(updates, nodes, parent, server, order, routes, shared, now) -> float
 *       tree_cost.estimate (each link a first-come queue at its capacity), its whole loop:
 *       `updates` the (ready, bytes, id, source) tuples in the round's order, `nodes` the
 *       aggregates (aggregator, parent, members), `parent` payload id -> aggregate id,
 *       `order` the aggregate ids sorted (the Python heap's tie-break), `routes` a
 *       tree_routes.Routes and `shared` its in-tree routes' link ids by (source,
 *       destination) (made here as _ServerRoutes.pair_ids makes them where a pair is not
 *       there yet); then routes.sync() and routes.free (copied), routes.per.
 *
 *   build(groups, depth, index, below, top, rank, host_of, points, prefix, bypass, fan_in,
 *         Node, fields) -> (nodes, parent)
 *       trees._build (with trees._sum): the aggregates of the candidate tree summing at
 *       `points` (the _Tree's fields passed one by one).
 *
 *   follows(transfers, busy, ids) -> list of tuples
 *       convert.schedule_to_decision's `after` of each transfer: the payloads ending on one
 *       of its links exactly when it starts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static PyObject *str_times, *str_residual, *str_eps, *fmt_over;

/* ------------------------------------------------------------------ LinkTimeline.reserve */

static int list_set_float(PyObject *list, Py_ssize_t i, double v) {
    PyObject *o = PyFloat_FromDouble(v);
    if (o == NULL) return -1;
    return PyList_SetItem(list, i, o); /* steals o */
}

static int list_append_obj(PyObject *list, PyObject *o) { return PyList_Append(list, o); }

static int list_del(PyObject *list, Py_ssize_t i) { return PyList_SetSlice(list, i, i + 1, NULL); }

#define F(list, i) PyFloat_AS_DOUBLE(PyList_GET_ITEM((list), (i)))

static int all_floats(PyObject *list) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyFloat_CheckExact(PyList_GET_ITEM(list, i))) return 0;
    return 1;
}

/* bisect_right(times, x, lo) */
static Py_ssize_t bisect_right(PyObject *times, double x, Py_ssize_t lo) {
    Py_ssize_t hi = PyList_GET_SIZE(times);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < F(times, mid))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static int over_error(PyObject *who, double rate, double t, double r) {
    PyObject *msg = PyObject_CallMethod(fmt_over, "format", "dOdd", rate, who, t, r);
    if (msg != NULL) {
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return -1;
}

/* LinkTimeline.reserve on its lists; start/end as objects (stored as given). 0 or -1. */
static int reserve_lists(PyObject *times, PyObject *residual, double eps, PyObject *start_o, PyObject *end_o,
                         double rate, PyObject *who) {
    double start = PyFloat_AS_DOUBLE(start_o), end = PyFloat_AS_DOUBLE(end_o);
    if (end <= start || rate <= 0) return 0;
    Py_ssize_t last = PyList_GET_SIZE(times) - 1;
    double c = F(residual, last);
    double left = c - rate;
    double tl = F(times, last);
    if (start >= tl && left >= -eps) {
        left = left < 0.0 ? 0.0 : left;
        if (start != tl) {
            if (fabs(c - left) > eps) {
                PyObject *c_o = PyList_GET_ITEM(residual, last);
                if (list_append_obj(times, start_o) < 0 || list_append_obj(times, end_o) < 0) return -1;
                PyObject *l_o = PyFloat_FromDouble(left);
                if (l_o == NULL) return -1;
                int rc = PyList_Append(residual, l_o);
                Py_DECREF(l_o);
                if (rc < 0 || PyList_Append(residual, c_o) < 0) return -1;
            }
            return 0;
        }
        PyObject *c_o = PyList_GET_ITEM(residual, last);
        Py_INCREF(c_o);
        if (list_set_float(residual, last, left) < 0) {
            Py_DECREF(c_o);
            return -1;
        }
        if (fabs(c - left) > eps) {
            if (list_append_obj(times, end_o) < 0 || list_append_obj(residual, c_o) < 0) {
                Py_DECREF(c_o);
                return -1;
            }
        }
        Py_DECREF(c_o);
        if (last > 0 && fabs(left - F(residual, last - 1)) <= eps) {
            if (list_del(times, last) < 0 || list_del(residual, last) < 0) return -1;
        }
        return 0;
    }
    Py_ssize_t i = bisect_right(times, start, 0) - 1;
    if (i < 0) {
        PyObject *r0 = PyList_GET_ITEM(residual, 0);
        if (PyList_Insert(times, 0, start_o) < 0 || PyList_Insert(residual, 0, r0) < 0) return -1;
        i = 0;
    } else if (F(times, i) != start) {
        i += 1;
        PyObject *prev = PyList_GET_ITEM(residual, i - 1);
        if (PyList_Insert(times, i, start_o) < 0 || PyList_Insert(residual, i, prev) < 0) return -1;
    }
    Py_ssize_t j = bisect_right(times, end, i) - 1;
    if (F(times, j) != end) {
        j += 1;
        PyObject *prev = PyList_GET_ITEM(residual, j - 1);
        if (PyList_Insert(times, j, end_o) < 0 || PyList_Insert(residual, j, prev) < 0) return -1;
    }
    for (Py_ssize_t k = i; k < j; k++) {
        double r = F(residual, k);
        double lft = r - rate;
        if (lft < -eps) return over_error(who, rate, F(times, k), r);
        if (list_set_float(residual, k, lft < 0.0 ? 0.0 : lft) < 0) return -1;
    }
    Py_ssize_t lo = i > 0 ? i - 1 : 0;
    Py_ssize_t n = PyList_GET_SIZE(times) - 1;
    Py_ssize_t k = j + 1 < n ? j + 1 : n;
    while (k > lo) {
        if (fabs(F(residual, k) - F(residual, k - 1)) <= eps) {
            if (list_del(times, k) < 0 || list_del(residual, k) < 0) return -1;
        }
        k -= 1;
    }
    return 0;
}

typedef struct {
    PyObject *times, *residual; /* borrowed from the timeline (kept alive by it) */
    double eps;
    PyObject *tl;
} Lane;

static int lane_of(PyObject *tl, Lane *out) {
    PyObject *times = PyObject_GetAttr(tl, str_times);
    if (times == NULL) return -1;
    PyObject *residual = PyObject_GetAttr(tl, str_residual);
    if (residual == NULL) {
        Py_DECREF(times);
        return -1;
    }
    PyObject *eps = PyObject_GetAttr(tl, str_eps);
    /* the timeline keeps its lists alive for as long as we use them */
    Py_DECREF(times);
    Py_DECREF(residual);
    if (eps == NULL) return -1;
    out->eps = PyFloat_AsDouble(eps);
    Py_DECREF(eps);
    if (out->eps == -1.0 && PyErr_Occurred()) return -1;
    if (!PyList_CheckExact(times) || !PyList_CheckExact(residual)) {
        PyErr_SetString(PyExc_TypeError, "a timeline's times and residual must be lists");
        return -1;
    }
    out->times = times;
    out->residual = residual;
    out->tl = tl;
    return 0;
}

/* ------------------------------------------------------------------ Timelines.transfer */

typedef struct {
    PyObject *lo, *hi; /* new references */
    double rate;
} Piece;

typedef struct {
    Piece *p;
    Py_ssize_t n, cap;
} Pieces;

static void pieces_free(Pieces *ps) {
    for (Py_ssize_t k = 0; k < ps->n; k++) {
        Py_XDECREF(ps->p[k].lo);
        Py_XDECREF(ps->p[k].hi);
    }
    PyMem_Free(ps->p);
    ps->p = NULL;
    ps->n = ps->cap = 0;
}

/* append (t, hi, rate), merging with the last piece as _walk does; steals nothing */
static int pieces_add(Pieces *ps, PyObject *t, PyObject *hi, double rate) {
    if (ps->n > 0) {
        Piece *last = &ps->p[ps->n - 1];
        if (last->rate == rate && PyFloat_AS_DOUBLE(last->hi) == PyFloat_AS_DOUBLE(t)) {
            Py_INCREF(hi);
            Py_SETREF(last->hi, hi);
            return 0;
        }
    }
    if (ps->n == ps->cap) {
        Py_ssize_t cap = ps->cap ? 2 * ps->cap : 8;
        Piece *np = PyMem_Realloc(ps->p, cap * sizeof(Piece));
        if (np == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ps->p = np;
        ps->cap = cap;
    }
    Py_INCREF(t);
    Py_INCREF(hi);
    ps->p[ps->n].lo = t;
    ps->p[ps->n].hi = hi;
    ps->p[ps->n].rate = rate;
    ps->n++;
    return 0;
}

#define MAX_LINKS 64

/* Timelines._walk with record=True over the lanes. 1: done (start in *start_o, new ref);
   0: never has residual bandwidth; -1: error. */
static int walk(Lane *lanes, Py_ssize_t nl, double nbytes, PyObject *ready, Pieces *ps, PyObject **start_o,
                PyObject **end_o) {
    double cap = INFINITY;
    Lane *var[MAX_LINKS];
    Py_ssize_t n = 0;
    *start_o = *end_o = NULL;
    if (nl == 0 || nbytes <= 0) {
        Py_INCREF(ready);
        Py_INCREF(ready);
        *start_o = ready;
        *end_o = ready;
        return 1;
    }
    for (Py_ssize_t k = 0; k < nl; k++) {
        Lane *l = &lanes[k];
        if (PyList_GET_SIZE(l->times) == 1) {
            double r = F(l->residual, 0);
            if (r <= l->eps) return 0;
            cap = cap < r ? cap : r; /* min(cap, r) */
        } else {
            var[n++] = l;
        }
    }
    PyObject *t_o = ready;
    double t = PyFloat_AS_DOUBLE(ready);
    double remaining = nbytes;
    if (n == 0) {
        PyObject *fin = PyFloat_FromDouble(t + remaining / cap);
        if (fin == NULL) return -1;
        if (pieces_add(ps, t_o, fin, cap) < 0) {
            Py_DECREF(fin);
            return -1;
        }
        Py_INCREF(t_o);
        *start_o = t_o;
        *end_o = fin;
        return 1;
    }
    Py_ssize_t index[MAX_LINKS];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = bisect_right(var[k]->times, t, 0) - 1;
        index[k] = i < 0 ? 0 : i;
    }
    PyObject *start = NULL; /* borrowed until returned */
    for (;;) {
        double rate = cap, nxt = INFINITY, blocked = -INFINITY;
        PyObject *nxt_o = NULL, *blocked_o = NULL;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *times = var[k]->times;
            Py_ssize_t i = index[k], last = PyList_GET_SIZE(times) - 1;
            while (i < last && F(times, i + 1) <= t) i++;
            index[k] = i;
            double r = F(var[k]->residual, i);
            double following = i < last ? F(times, i + 1) : INFINITY;
            PyObject *following_o = i < last ? PyList_GET_ITEM(times, i + 1) : NULL;
            if (r <= var[k]->eps) {
                r = 0.0;
                if (following > blocked) {
                    blocked = following;
                    blocked_o = following_o;
                }
            }
            if (r < rate) rate = r;
            if (following < nxt) {
                nxt = following;
                nxt_o = following_o;
            }
        }
        if (rate <= 0.0) {
            if (blocked == INFINITY) return 0;
            t = blocked;
            t_o = blocked_o;
            continue;
        }
        if (start == NULL) start = t_o;
        double finish = t + remaining / rate;
        int done = finish <= nxt;
        PyObject *fin = NULL, *hi;
        if (done) {
            fin = PyFloat_FromDouble(finish);
            if (fin == NULL) return -1;
            hi = fin;
        } else {
            hi = nxt_o;
        }
        if (pieces_add(ps, t_o, hi, rate) < 0) {
            Py_XDECREF(fin);
            return -1;
        }
        if (done) {
            Py_INCREF(start);
            *start_o = start;
            *end_o = fin;
            return 1;
        }
        remaining -= rate * (nxt - t);
        t = nxt;
        t_o = nxt_o;
    }
}

/* The walk and reservation of one transfer over `links` (a tuple of links): (start, end,
   reservations), None where the Python loops are to run (nothing changed then), NULL on error. */
static PyObject *fast_transfer(PyObject *tls, PyObject *links, double nbytes, PyObject *ready, PyObject *who,
                               PyObject *cls) {
    Py_ssize_t nl = PyTuple_GET_SIZE(links);
    if (nl > MAX_LINKS || !PyFloat_CheckExact(ready)) Py_RETURN_NONE;
    Lane lanes[MAX_LINKS];
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *tl = PyDict_GetItemWithError(tls, PyTuple_GET_ITEM(links, k));
        if (tl == NULL) {
            if (PyErr_Occurred()) return NULL;
            Py_RETURN_NONE;
        }
        if (lane_of(tl, &lanes[k]) < 0) return NULL;
        if (!all_floats(lanes[k].times) || !all_floats(lanes[k].residual)) Py_RETURN_NONE;
    }
    Pieces ps = {NULL, 0, 0};
    PyObject *start = NULL, *end = NULL, *res = NULL;
    int got = walk(lanes, nl, nbytes, ready, &ps, &start, &end);
    if (got <= 0) {
        pieces_free(&ps);
        if (got < 0) return NULL;
        Py_RETURN_NONE;
    }
    res = PyTuple_New(nl * ps.n);
    if (res == NULL) goto fail;
    Py_ssize_t m = 0;
    PyTypeObject *type = (PyTypeObject *)cls;
    for (Py_ssize_t k = 0; k < nl; k++) {
        PyObject *link = PyTuple_GET_ITEM(links, k);
        for (Py_ssize_t q = 0; q < ps.n; q++) {
            Piece *p = &ps.p[q];
            if (reserve_lists(lanes[k].times, lanes[k].residual, lanes[k].eps, p->lo, p->hi, p->rate, who) < 0)
                goto fail;
            PyObject *r = type->tp_alloc(type, 4);
            if (r == NULL) goto fail;
            PyObject *rate = PyFloat_FromDouble(p->rate);
            if (rate == NULL) {
                Py_DECREF(r);
                goto fail;
            }
            Py_INCREF(link);
            Py_INCREF(p->lo);
            Py_INCREF(p->hi);
            PyTuple_SET_ITEM(r, 0, link);
            PyTuple_SET_ITEM(r, 1, p->lo);
            PyTuple_SET_ITEM(r, 2, p->hi);
            PyTuple_SET_ITEM(r, 3, rate);
            PyTuple_SET_ITEM(res, m++, r);
        }
    }
    pieces_free(&ps);
    PyObject *out = PyTuple_Pack(3, start, end, res);
    Py_DECREF(start);
    Py_DECREF(end);
    Py_DECREF(res);
    return out;
fail:
    pieces_free(&ps);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(res);
    return NULL;
}

static PyObject *py_transfer(PyObject *self, PyObject *args) {
    PyObject *tls, *links, *ready, *who, *cls;
    double nbytes;
    if (!PyArg_ParseTuple(args, "O!O!dOOO", &PyDict_Type, &tls, &PyTuple_Type, &links, &nbytes, &ready, &who, &cls))
        return NULL;
    return fast_transfer(tls, links, nbytes, ready, who, cls);
}

/* ------------------------------------------------------------------ tree_cost.estimate */

typedef struct {
    double ready, nbytes;
    Py_ssize_t rank, pid;
} Entry;

static int entry_less(const Entry *a, const Entry *b) {
    if (a->ready != b->ready) return a->ready < b->ready;
    if (a->nbytes != b->nbytes) return a->nbytes < b->nbytes;
    return a->rank < b->rank;
}

static void heap_push(Entry *h, Py_ssize_t *n, Entry e) {
    Py_ssize_t i = (*n)++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!entry_less(&e, &h[up])) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static Entry heap_pop(Entry *h, Py_ssize_t *n) {
    Entry top = h[0], e = h[--(*n)];
    Py_ssize_t i = 0, size = *n;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= size) break;
        if (c + 1 < size && entry_less(&h[c + 1], &h[c])) c++;
        if (!entry_less(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    if (size > 0) h[i] = e;
    return top;
}

static double *floats_of(PyObject *seq, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of floats");
    if (fast == NULL) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(fast);
    double *out = PyMem_Malloc((len ? len : 1) * sizeof(double));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < len; i++) {
        out[i] = PyFloat_AsDouble(items[i]);
        if (out[i] == -1.0 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n = len;
    return out;
}

static PyObject *str_aggregator, *str_parent, *str_members, *str_free, *str_per, *str_grow;

static PyObject *str_hosts, *str_dsts, *str_host, *str_dst_m, *str_pair_ids, *str_path, *str_up, *str_pos,
    *str_down, *str_server, *str_tree, *empty_tuple;

/* _ServerRoutes.pair_ids(src, dst) where the route meets in the tree (new reference); the
   Python method otherwise. Stores the route in the shared dict as the method does. */
static PyObject *pair_ids(PyObject *tree, PyObject *shared, PyObject *key, PyObject *src, PyObject *dst) {
    PyObject *out = NULL, *hosts = NULL, *up = NULL, *up_path = NULL, *up_ids = NULL, *server = NULL;
    PyObject *dsts = NULL, *down = NULL, *pos = NULL, *down_ids = NULL;
    if ((hosts = PyObject_GetAttr(tree, str_hosts)) == NULL) goto done;
    up = PyDict_GetItemWithError(hosts, src);
    if (up != NULL) {
        Py_INCREF(up);
    } else {
        if (PyErr_Occurred()) goto done;
        if ((up = PyObject_CallMethodOneArg(tree, str_host, src)) == NULL) goto done;
    }
    if ((server = PyObject_GetAttr(tree, str_server)) == NULL) goto done;
    if ((up_ids = PyObject_GetAttr(up, str_up)) == NULL) goto done;
    int is_server = PyUnicode_Compare(dst, server) == 0;
    if (is_server && PyErr_Occurred()) goto done;
    if (is_server) {
        out = up_ids;
        Py_INCREF(out);
    } else {
        if ((dsts = PyObject_GetAttr(tree, str_dsts)) == NULL) goto done;
        down = PyDict_GetItemWithError(dsts, dst);
        if (down != NULL) {
            Py_INCREF(down);
        } else {
            if (PyErr_Occurred()) goto done;
            if ((down = PyObject_CallMethodOneArg(tree, str_dst_m, dst)) == NULL) goto done;
        }
        if ((up_path = PyObject_GetAttr(up, str_path)) == NULL) goto done;
        if ((pos = PyObject_GetAttr(down, str_pos)) == NULL) goto done;
        if ((down_ids = PyObject_GetAttr(down, str_down)) == NULL) goto done;
        if (!PyTuple_CheckExact(up_path) || !PyTuple_CheckExact(up_ids) || !PyTuple_CheckExact(down_ids) ||
            !PyDict_CheckExact(pos)) {
            PyErr_SetString(PyExc_TypeError, "pair_ids: unexpected route types");
            goto done;
        }
        Py_ssize_t i = -1, j = -1, len = PyTuple_GET_SIZE(up_path), nd = PyTuple_GET_SIZE(down_ids);
        for (Py_ssize_t k = 0; k < len; k++) {
            PyObject *jo = PyDict_GetItemWithError(pos, PyTuple_GET_ITEM(up_path, k));
            if (jo != NULL) {
                i = k;
                j = PyLong_AsSsize_t(jo);
                break;
            }
            if (PyErr_Occurred()) goto done;
        }
        if (i < 0 || j > nd) { /* no meeting point in the tree: the method goes round */
            out = PyObject_CallMethodObjArgs(tree, str_pair_ids, src, dst, NULL);
            goto done;
        }
        Py_ssize_t nu = i < PyTuple_GET_SIZE(up_ids) ? i : PyTuple_GET_SIZE(up_ids);
        if ((out = PyTuple_New(nu + j)) == NULL) goto done;
        for (Py_ssize_t k = 0; k < nu; k++) {
            PyObject *x = PyTuple_GET_ITEM(up_ids, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, k, x);
        }
        for (Py_ssize_t k = 0; k < j; k++) { /* down.down[j - 1 :: -1] */
            PyObject *x = PyTuple_GET_ITEM(down_ids, j - 1 - k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, nu + k, x);
        }
    }
    if (PyDict_SetItem(shared, key, out) < 0) Py_CLEAR(out);
done:
    Py_XDECREF(hosts);
    Py_XDECREF(up);
    Py_XDECREF(up_path);
    Py_XDECREF(up_ids);
    Py_XDECREF(server);
    Py_XDECREF(dsts);
    Py_XDECREF(down);
    Py_XDECREF(pos);
    Py_XDECREF(down_ids);
    return out;
}

/* routes.tree_ids(src, dst) (new reference): the shared dict, else computed as pair_ids */
static PyObject *route_ids(PyObject *shared, PyObject *tree, PyObject *src, PyObject *dst) {
    PyObject *key = PyTuple_Pack(2, src, dst);
    if (key == NULL) return NULL;
    PyObject *got = PyDict_GetItemWithError(shared, key);
    if (got != NULL) {
        Py_DECREF(key);
        Py_INCREF(got);
        return got;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    int same = PyUnicode_Compare(src, dst) == 0;
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    if (same) {
        Py_DECREF(key);
        Py_INCREF(empty_tuple);
        return empty_tuple;
    }
    got = pair_ids(tree, shared, key, src, dst);
    Py_DECREF(key);
    if (got != NULL && !PyTuple_CheckExact(got)) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "estimate: a route must be a tuple of link ids");
        return NULL;
    }
    return got;
}

static PyObject *py_estimate(PyObject *self, PyObject *args) {
    PyObject *updates, *nodes, *parent, *server, *order, *routes, *shared, *tree = NULL;
    double now;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!OO!d", &PyList_Type, &updates, &PyDict_Type, &nodes, &PyDict_Type,
                          &parent, &server, &PyList_Type, &order, &routes, &PyDict_Type, &shared, &now))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(updates), na = PyDict_GET_SIZE(nodes), total = n + na;
    Py_ssize_t nlinks = 0, nper = 0;
    PyObject *out = NULL, *pos = NULL, *free_s = NULL, *per_s = NULL;
    PyObject **paths = PyMem_Calloc(total ? total : 1, sizeof(PyObject *));
    PyObject **nodeobjs = PyMem_Calloc(na ? na : 1, sizeof(PyObject *)); /* borrowed */
    double *ready = PyMem_Malloc((n ? n : 1) * sizeof(double));
    double *bytes = PyMem_Malloc((n ? n : 1) * sizeof(double));
    Py_ssize_t *to = PyMem_Malloc((total ? total : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *waiting = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    Py_ssize_t *rank = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    double *agg_ready = PyMem_Malloc((na ? na : 1) * sizeof(double));
    Entry *heap = PyMem_Malloc((na ? na : 1) * sizeof(Entry));
    double *busy = NULL, *per = NULL;
    if (!paths || !nodeobjs || !ready || !bytes || !to || !waiting || !rank || !agg_ready || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    if ((pos = PyDict_New()) == NULL) goto done;
    if ((tree = PyObject_GetAttr(routes, str_tree)) == NULL) goto done;
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) {
            PyObject *idx = PyLong_FromSsize_t(k);
            if (idx == NULL || PyDict_SetItem(pos, aid, idx) < 0) {
                Py_XDECREF(idx);
                goto done;
            }
            Py_DECREF(idx);
            nodeobjs[k++] = node;
        }
    }
    if (PyList_GET_SIZE(order) != na) {
        PyErr_SetString(PyExc_ValueError, "estimate: order must list every aggregate");
        goto done;
    }
    for (Py_ssize_t r = 0; r < na; r++) {
        PyObject *idx = PyDict_GetItemWithError(pos, PyList_GET_ITEM(order, r));
        if (idx == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "estimate: an ordered id is no aggregate");
            goto done;
        }
        rank[PyLong_AsSsize_t(idx)] = r;
    }
    /* each payload's links (resolved first: link ids are made on first use) and aggregate */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *u = PyList_GET_ITEM(updates, i);
        if (!PyTuple_CheckExact(u) || PyTuple_GET_SIZE(u) != 4) {
            PyErr_SetString(PyExc_TypeError, "estimate: an update must be (ready, bytes, id, source)");
            goto done;
        }
        ready[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(u, 0));
        bytes[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(u, 1));
        if (PyErr_Occurred()) goto done;
        PyObject *a = PyDict_GetItemWithError(parent, PyTuple_GET_ITEM(u, 2));
        PyObject *dst;
        if (a == NULL) {
            if (PyErr_Occurred()) goto done;
            dst = server;
            Py_INCREF(dst);
            to[i] = -1;
        } else {
            PyObject *idx = PyDict_GetItemWithError(pos, a);
            if (idx == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, a);
                goto done;
            }
            Py_ssize_t k = PyLong_AsSsize_t(idx);
            to[i] = n + k;
            if ((dst = PyObject_GetAttr(nodeobjs[k], str_aggregator)) == NULL) goto done;
        }
        paths[i] = route_ids(shared, tree, PyTuple_GET_ITEM(u, 3), dst);
        Py_DECREF(dst);
        if (paths[i] == NULL) goto done;
    }
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) {
            PyObject *agg = PyObject_GetAttr(node, str_aggregator);
            if (agg == NULL) goto done;
            PyObject *up = PyObject_GetAttr(node, str_parent);
            if (up == NULL) {
                Py_DECREF(agg);
                goto done;
            }
            PyObject *dst;
            if (up == Py_None) {
                dst = server;
                Py_INCREF(dst);
            } else {
                PyObject *upnode = PyDict_GetItemWithError(nodes, up);
                if (upnode == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, up);
                    Py_DECREF(up);
                    Py_DECREF(agg);
                    goto done;
                }
                dst = PyObject_GetAttr(upnode, str_aggregator);
            }
            Py_DECREF(up);
            if (dst == NULL) {
                Py_DECREF(agg);
                goto done;
            }
            paths[n + k] = route_ids(shared, tree, agg, dst);
            Py_DECREF(agg);
            Py_DECREF(dst);
            if (paths[n + k] == NULL) goto done;
            PyObject *a = PyDict_GetItemWithError(parent, aid);
            if (a == NULL) {
                if (PyErr_Occurred()) goto done;
                to[n + k] = -1;
            } else {
                PyObject *idx = PyDict_GetItemWithError(pos, a);
                if (idx == NULL) {
                    if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, a);
                    goto done;
                }
                to[n + k] = n + PyLong_AsSsize_t(idx);
            }
            PyObject *members = PyObject_GetAttr(node, str_members);
            if (members == NULL) goto done;
            waiting[k] = PyObject_Length(members);
            Py_DECREF(members);
            if (waiting[k] < 0) goto done;
            k++;
        }
    }
    /* link ids made while resolving: their per-byte and free times (Routes._grow) */
    PyObject *grown = PyObject_CallMethodNoArgs(routes, str_grow);
    if (grown == NULL) goto done;
    Py_DECREF(grown);
    if ((free_s = PyObject_GetAttr(routes, str_free)) == NULL) goto done;
    if ((per_s = PyObject_GetAttr(routes, str_per)) == NULL) goto done;
    if ((busy = floats_of(free_s, &nlinks)) == NULL) goto done;
    if ((per = floats_of(per_s, &nper)) == NULL) goto done;
    if (nper < nlinks) {
        PyErr_SetString(PyExc_ValueError, "estimate: fewer per-byte times than links");
        goto done;
    }
    for (Py_ssize_t a = 0; a < na; a++) agg_ready[a] = -INFINITY;
    Py_ssize_t hn = 0, i = 0;
    double makespan = now;
    while (i < n || hn) {
        Entry e;
        if (hn && (i >= n || heap[0].ready < ready[i])) {
            e = heap_pop(heap, &hn);
        } else {
            e.ready = ready[i];
            e.nbytes = bytes[i];
            e.pid = i;
            e.rank = 0;
            i++;
        }
        double end = e.ready;
        PyObject *path = paths[e.pid];
        Py_ssize_t len = PyTuple_GET_SIZE(path);
        for (Py_ssize_t k = 0; k < len; k++) {
            Py_ssize_t link = PyLong_AsSsize_t(PyTuple_GET_ITEM(path, k));
            if (link < 0 || link >= nlinks) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "estimate: link id out of range");
                goto done;
            }
            double at = busy[link];
            double done_at = (e.ready > at ? e.ready : at) + e.nbytes * per[link];
            busy[link] = done_at;
            if (done_at > end) end = done_at;
        }
        Py_ssize_t dst = to[e.pid];
        if (dst < 0) {
            if (end > makespan) makespan = end;
            continue;
        }
        Py_ssize_t a = dst - n;
        waiting[a] -= 1;
        if (end > agg_ready[a]) agg_ready[a] = end;
        if (waiting[a] == 0) {
            Entry g = {agg_ready[a], e.nbytes, rank[a], dst};
            heap_push(heap, &hn, g);
        }
    }
    out = PyFloat_FromDouble(makespan);
done:
    if (paths != NULL)
        for (Py_ssize_t k = 0; k < total; k++) Py_XDECREF(paths[k]);
    PyMem_Free(paths);
    PyMem_Free(nodeobjs);
    Py_XDECREF(pos);
    Py_XDECREF(tree);
    Py_XDECREF(free_s);
    Py_XDECREF(per_s);
    PyMem_Free(ready);
    PyMem_Free(bytes);
    PyMem_Free(busy);
    PyMem_Free(per);
    PyMem_Free(to);
    PyMem_Free(waiting);
    PyMem_Free(rank);
    PyMem_Free(agg_ready);
    PyMem_Free(heap);
    return out;
}

/* ------------------------------------------------------------------ tree_cost.reserve */

static PyObject *str_walks, *str_back, *str_pair_path, *str_links, *str_link, *str_transfer, *str_end, *str_update_id,
    *str_src, *a_transfer;

/* routes.tree_path(src, dst) (new reference): _ServerRoutes.walks, else pair_path's route */
static PyObject *tree_path(PyObject *tree, PyObject *walks, PyObject *src, PyObject *dst) {
    PyObject *key = PyTuple_Pack(2, src, dst);
    if (key == NULL) return NULL;
    PyObject *out = PyDict_GetItemWithError(walks, key);
    if (out != NULL || PyErr_Occurred()) {
        Py_DECREF(key);
        Py_XINCREF(out);
        return out;
    }
    PyObject *hosts = NULL, *up = NULL, *up_path = NULL, *server = NULL, *dsts = NULL, *down = NULL, *pos = NULL,
             *back = NULL;
    int same = PyUnicode_Compare(src, dst) == 0;
    if (PyErr_Occurred()) goto done;
    if (same) {
        out = PyTuple_Pack(1, src);
        goto done;
    }
    if ((hosts = PyObject_GetAttr(tree, str_hosts)) == NULL) goto done;
    up = PyDict_GetItemWithError(hosts, src);
    if (up != NULL) {
        Py_INCREF(up);
    } else {
        if (PyErr_Occurred()) goto done;
        if ((up = PyObject_CallMethodOneArg(tree, str_host, src)) == NULL) goto done;
    }
    if ((up_path = PyObject_GetAttr(up, str_path)) == NULL) goto done;
    if ((server = PyObject_GetAttr(tree, str_server)) == NULL) goto done;
    int is_server = PyUnicode_Compare(dst, server) == 0;
    if (PyErr_Occurred()) goto done;
    if (is_server) {
        out = up_path;
        Py_INCREF(out);
    } else {
        if ((dsts = PyObject_GetAttr(tree, str_dsts)) == NULL) goto done;
        down = PyDict_GetItemWithError(dsts, dst);
        if (down != NULL) {
            Py_INCREF(down);
        } else {
            if (PyErr_Occurred()) goto done;
            if ((down = PyObject_CallMethodOneArg(tree, str_dst_m, dst)) == NULL) goto done;
        }
        if ((pos = PyObject_GetAttr(down, str_pos)) == NULL) goto done;
        if ((back = PyObject_GetAttr(down, str_back)) == NULL) goto done;
        PyObject *down_ids = PyObject_GetAttr(down, str_down);
        if (down_ids == NULL) goto done;
        Py_ssize_t nd = PyObject_Length(down_ids);
        Py_DECREF(down_ids);
        if (nd < 0) goto done;
        if (!PyTuple_CheckExact(up_path) || !PyTuple_CheckExact(back) || !PyDict_CheckExact(pos)) {
            PyErr_SetString(PyExc_TypeError, "tree_path: unexpected route types");
            goto done;
        }
        Py_ssize_t i = -1, j = -1, len = PyTuple_GET_SIZE(up_path), nb = PyTuple_GET_SIZE(back);
        for (Py_ssize_t k = 0; k < len; k++) {
            PyObject *jo = PyDict_GetItemWithError(pos, PyTuple_GET_ITEM(up_path, k));
            if (jo != NULL) {
                i = k;
                j = PyLong_AsSsize_t(jo);
                break;
            }
            if (PyErr_Occurred()) goto done;
        }
        if (i < 0 || j > nd) { /* no meeting point in the tree: the method goes round */
            out = PyObject_CallMethodObjArgs(tree, str_pair_path, src, dst, NULL);
            goto done;
        }
        /* up.path[:i] + down.back[len(down.back) - 1 - j :] */
        Py_ssize_t from = nb - 1 - j;
        if ((out = PyTuple_New(i + (nb - from))) == NULL) goto done;
        for (Py_ssize_t k = 0; k < i; k++) {
            PyObject *x = PyTuple_GET_ITEM(up_path, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, k, x);
        }
        for (Py_ssize_t k = from; k < nb; k++) {
            PyObject *x = PyTuple_GET_ITEM(back, k);
            Py_INCREF(x);
            PyTuple_SET_ITEM(out, i + k - from, x);
        }
    }
    if (PyDict_SetItem(walks, key, out) < 0) Py_CLEAR(out);
done:
    Py_DECREF(key);
    Py_XDECREF(hosts);
    Py_XDECREF(up);
    Py_XDECREF(up_path);
    Py_XDECREF(server);
    Py_XDECREF(dsts);
    Py_XDECREF(down);
    Py_XDECREF(pos);
    Py_XDECREF(back);
    return out;
}

/* cls(*values) for a dataclass whose __init__ only sets `fields` (no __post_init__): the instance's
   dict filled in field order, as __init__ fills it (new reference); cls(*values) where `fields`
   is None */
static PyObject *make_instance(PyObject *cls, PyObject *fields, PyObject *const *values, Py_ssize_t n) {
    if (fields == Py_None || !PyType_Check(cls)) return PyObject_Vectorcall(cls, values, n, NULL);
    if (!PyTuple_CheckExact(fields) || PyTuple_GET_SIZE(fields) < n) {
        PyErr_SetString(PyExc_TypeError, "make_instance: fields must name every value");
        return NULL;
    }
    PyObject *obj = PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty_tuple, NULL);
    if (obj == NULL) return NULL;
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (dict == NULL) {
        Py_DECREF(obj);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyDict_SetItem(dict, PyTuple_GET_ITEM(fields, k), values[k]) < 0) {
            Py_DECREF(dict);
            Py_DECREF(obj);
            return NULL;
        }
    }
    Py_DECREF(dict);
    return obj;
}

/* Timelines.transfer(pid, hops, nbytes, ready) (new reference): C where it can, the method else */
static PyObject *one_transfer(PyObject *tls_obj, PyObject *tls, PyObject *hops, PyObject *pid, PyObject *nbytes_o,
                              PyObject *ready, PyObject *transfer_cls, PyObject *reservation_cls, PyObject *fields) {
    Py_ssize_t nh = PyTuple_GET_SIZE(hops);
    PyObject *links = PyTuple_New(nh > 1 ? nh - 1 : 0);
    if (links == NULL) return NULL;
    for (Py_ssize_t k = 0; k + 1 < nh; k++) {
        PyObject *link = PyTuple_Pack(2, PyTuple_GET_ITEM(hops, k), PyTuple_GET_ITEM(hops, k + 1));
        if (link == NULL) {
            Py_DECREF(links);
            return NULL;
        }
        PyTuple_SET_ITEM(links, k, link);
    }
    double nbytes = PyFloat_AsDouble(nbytes_o);
    int truthy = PyObject_IsTrue(pid);
    if ((nbytes == -1.0 || truthy < 0) && PyErr_Occurred()) {
        Py_DECREF(links);
        return NULL;
    }
    PyObject *who = truthy ? pid : a_transfer;
    PyObject *got = NULL;
    for (int attempt = 0; attempt < 2; attempt++) {
        got = fast_transfer(tls, links, nbytes, ready, who, reservation_cls);
        if (got != Py_None) break;
        Py_DECREF(got);
        got = NULL;
        if (attempt == 1) break;
        int made = 0; /* make the missing timelines, in path order (as the walk would) */
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(links); k++) {
            PyObject *link = PyTuple_GET_ITEM(links, k);
            int has = PyDict_Contains(tls, link);
            if (has < 0) {
                Py_DECREF(links);
                return NULL;
            }
            if (!has) {
                PyObject *tl = PyObject_CallMethodOneArg(tls_obj, str_link, link);
                if (tl == NULL) {
                    Py_DECREF(links);
                    return NULL;
                }
                Py_DECREF(tl);
                made = 1;
            }
        }
        if (!made) break;
    }
    if (got == NULL && PyErr_Occurred()) {
        Py_DECREF(links);
        return NULL;
    }
    PyObject *out;
    if (got == NULL) { /* the Python loops (they raise where the path never has residual bandwidth) */
        out = PyObject_CallMethodObjArgs(tls_obj, str_transfer, pid, hops, nbytes_o, ready, NULL);
    } else {
        PyObject *argv[9] = {pid,
                             PyTuple_GET_ITEM(hops, 0),
                             PyTuple_GET_ITEM(hops, nh - 1),
                             hops,
                             PyTuple_GET_ITEM(got, 0),
                             PyTuple_GET_ITEM(got, 1),
                             nbytes_o,
                             PyTuple_GET_ITEM(got, 2),
                             Py_False};
        out = make_instance(transfer_cls, fields, argv, fields == Py_None ? 8 : 9);
        Py_DECREF(got);
    }
    Py_DECREF(links);
    return out;
}

typedef struct {
    double ready;
    long made;
    PyObject *ready_o, *pid, *src; /* borrowed: kept alive by the arrays below */
} REntry;

static int rentry_less(const REntry *a, const REntry *b) {
    if (a->ready != b->ready) return a->ready < b->ready;
    return a->made < b->made;
}

static void rheap_push(REntry *h, Py_ssize_t *n, REntry e) {
    Py_ssize_t i = (*n)++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!rentry_less(&e, &h[up])) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static REntry rheap_pop(REntry *h, Py_ssize_t *n) {
    REntry top = h[0], e = h[--(*n)];
    Py_ssize_t i = 0, size = *n;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= size) break;
        if (c + 1 < size && rentry_less(&h[c + 1], &h[c])) c++;
        if (!rentry_less(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    if (size > 0) h[i] = e;
    return top;
}

static PyObject *py_reserve_tree(PyObject *self, PyObject *args) {
    PyObject *tls_obj, *routes, *order, *nodes, *parent, *server, *size, *readies, *now, *transfer_cls, *res_cls;
    PyObject *fields;
    if (!PyArg_ParseTuple(args, "OOO!O!O!OO!O!OOOO", &tls_obj, &routes, &PyList_Type, &order, &PyDict_Type, &nodes,
                          &PyDict_Type, &parent, &server, &PyDict_Type, &size, &PyList_Type, &readies, &now,
                          &transfer_cls, &res_cls, &fields))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(order), na = PyDict_GET_SIZE(nodes);
    if (PyList_GET_SIZE(readies) != n) {
        PyErr_SetString(PyExc_ValueError, "reserve_tree: one ready time per update");
        return NULL;
    }
    PyObject *tls = NULL, *tree = NULL, *walks = NULL, *pos = NULL, *transfers = NULL, *out = NULL;
    PyObject *makespan = now;
    Py_INCREF(makespan);
    PyObject **agg_host = PyMem_Calloc(na ? na : 1, sizeof(PyObject *));
    PyObject **agg_ready_o = PyMem_Calloc(na ? na : 1, sizeof(PyObject *));
    PyObject **agg_id = PyMem_Calloc(na ? na : 1, sizeof(PyObject *)); /* borrowed from nodes */
    double *agg_ready = PyMem_Malloc((na ? na : 1) * sizeof(double));
    double *ready_d = PyMem_Malloc((n ? n : 1) * sizeof(double));
    Py_ssize_t *waiting = PyMem_Malloc((na ? na : 1) * sizeof(Py_ssize_t));
    REntry *heap = PyMem_Malloc((na ? na : 1) * sizeof(REntry));
    if (!agg_host || !agg_ready_o || !agg_id || !agg_ready || !ready_d || !waiting || !heap) {
        PyErr_NoMemory();
        goto done;
    }
    if ((tls = PyObject_GetAttr(tls_obj, str_links)) == NULL) goto done;
    if (!PyDict_CheckExact(tls)) {
        PyErr_SetString(PyExc_TypeError, "reserve_tree: the timelines' links must be a dict");
        goto done;
    }
    if ((tree = PyObject_GetAttr(routes, str_tree)) == NULL) goto done;
    if ((walks = PyObject_GetAttr(tree, str_walks)) == NULL) goto done;
    if (!PyDict_CheckExact(walks)) {
        PyErr_SetString(PyExc_TypeError, "reserve_tree: the routes' walks must be a dict");
        goto done;
    }
    if ((pos = PyDict_New()) == NULL) goto done;
    if ((transfers = PyList_New(0)) == NULL) goto done;
    {
        Py_ssize_t it = 0, k = 0;
        PyObject *aid, *node;
        while (PyDict_Next(nodes, &it, &aid, &node)) {
            PyObject *idx = PyLong_FromSsize_t(k);
            if (idx == NULL || PyDict_SetItem(pos, aid, idx) < 0) {
                Py_XDECREF(idx);
                goto done;
            }
            Py_DECREF(idx);
            agg_id[k] = aid;
            if ((agg_host[k] = PyObject_GetAttr(node, str_aggregator)) == NULL) goto done;
            PyObject *members = PyObject_GetAttr(node, str_members);
            if (members == NULL) goto done;
            waiting[k] = PyObject_Length(members);
            Py_DECREF(members);
            if (waiting[k] < 0) goto done;
            agg_ready[k] = -INFINITY;
            k++;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ready_d[i] = PyFloat_AsDouble(PyList_GET_ITEM(readies, i));
        if (ready_d[i] == -1.0 && PyErr_Occurred()) goto done;
    }
    double makespan_d = PyFloat_AsDouble(now);
    if (makespan_d == -1.0 && PyErr_Occurred()) goto done;
    Py_ssize_t hn = 0, i = 0;
    long made = 0;
    while (i < n || hn) {
        PyObject *ready_o, *pid, *src;
        if (hn && (i >= n || heap[0].ready < ready_d[i])) {
            REntry e = rheap_pop(heap, &hn);
            ready_o = e.ready_o;
            Py_INCREF(ready_o);
            pid = e.pid;
            Py_INCREF(pid);
            src = e.src;
            Py_INCREF(src);
        } else {
            PyObject *u = PyList_GET_ITEM(order, i);
            ready_o = PyList_GET_ITEM(readies, i);
            Py_INCREF(ready_o);
            i++;
            pid = PyObject_GetAttr(u, str_update_id);
            src = pid == NULL ? NULL : PyObject_GetAttr(u, str_src);
            if (src == NULL) {
                Py_XDECREF(pid);
                Py_DECREF(ready_o);
                goto done;
            }
        }
        PyObject *to = PyDict_GetItemWithError(parent, pid);
        Py_ssize_t k = -1;
        PyObject *hop = server;
        if (to != NULL) {
            PyObject *idx = PyDict_GetItemWithError(pos, to);
            if (idx == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, to);
            } else {
                k = PyLong_AsSsize_t(idx);
                hop = agg_host[k];
            }
        }
        PyObject *t = NULL, *nbytes_o = NULL, *hops = NULL;
        if (!PyErr_Occurred()) {
            nbytes_o = PyDict_GetItemWithError(size, pid);
            if (nbytes_o == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pid);
        }
        if (nbytes_o != NULL) hops = tree_path(tree, walks, src, hop);
        if (hops != NULL && !PyTuple_CheckExact(hops)) {
            PyErr_SetString(PyExc_TypeError, "reserve_tree: a path must be a tuple");
            Py_CLEAR(hops);
        }
        if (hops != NULL) t = one_transfer(tls_obj, tls, hops, pid, nbytes_o, ready_o, transfer_cls, res_cls, fields);
        Py_XDECREF(hops);
        Py_DECREF(ready_o);
        Py_DECREF(pid);
        Py_DECREF(src);
        if (t == NULL) goto done;
        int rc = PyList_Append(transfers, t);
        PyObject *end_o = PyObject_GetAttr(t, str_end);
        Py_DECREF(t);
        if (rc < 0 || end_o == NULL) {
            Py_XDECREF(end_o);
            goto done;
        }
        double end = PyFloat_AsDouble(end_o);
        if (end == -1.0 && PyErr_Occurred()) {
            Py_DECREF(end_o);
            goto done;
        }
        if (k < 0) {
            if (end > makespan_d) {
                makespan_d = end;
                Py_SETREF(makespan, end_o);
            } else {
                Py_DECREF(end_o);
            }
            continue;
        }
        waiting[k] -= 1;
        if (end > agg_ready[k]) {
            agg_ready[k] = end;
            Py_XSETREF(agg_ready_o[k], end_o);
        } else {
            Py_DECREF(end_o);
        }
        if (waiting[k] == 0) {
            made += 1;
            REntry e = {agg_ready[k], made, agg_ready_o[k], agg_id[k], agg_host[k]};
            rheap_push(heap, &hn, e);
        }
    }
    out = PyTuple_Pack(2, transfers, makespan);
done:
    if (agg_host != NULL)
        for (Py_ssize_t k = 0; k < na; k++) Py_XDECREF(agg_host[k]);
    if (agg_ready_o != NULL)
        for (Py_ssize_t k = 0; k < na; k++) Py_XDECREF(agg_ready_o[k]);
    PyMem_Free(agg_host);
    PyMem_Free(agg_ready_o);
    PyMem_Free(agg_id);
    PyMem_Free(agg_ready);
    PyMem_Free(ready_d);
    PyMem_Free(waiting);
    PyMem_Free(heap);
    Py_XDECREF(tls);
    Py_XDECREF(tree);
    Py_XDECREF(walks);
    Py_XDECREF(pos);
    Py_XDECREF(transfers);
    Py_XDECREF(makespan);
    return out;
}

/* ------------------------------------------------------------------ convert.schedule_to_decision */

static PyObject *str_start, *str_payload_id;

typedef struct {
    double start;
    Py_ssize_t i;
} Start;

static int start_cmp(const void *a, const void *b) {
    const Start *x = a, *y = b;
    if (x->start < y->start) return -1;
    if (x->start > y->start) return 1;
    return x->i < y->i ? -1 : x->i > y->i; /* stable: the schedule's order among equal starts */
}

/* ends[link][at].append(pid), ends and ends[link] made where missing; borrowed ends[link] in *at_link */
static int add_end(PyObject *ends, PyObject *link, PyObject *at, PyObject *pid, PyObject **at_link) {
    PyObject *by = *at_link;
    if (by == NULL) {
        by = PyDict_GetItemWithError(ends, link);
        if (by == NULL) {
            if (PyErr_Occurred()) return -1;
            if ((by = PyDict_New()) == NULL) return -1;
            int rc = PyDict_SetItem(ends, link, by);
            Py_DECREF(by);
            if (rc < 0) return -1;
        }
        *at_link = by;
    }
    PyObject *got = PyDict_GetItemWithError(by, at);
    if (got == NULL) {
        if (PyErr_Occurred()) return -1;
        PyObject *list = PyList_New(1);
        if (list == NULL) return -1;
        Py_INCREF(pid);
        PyList_SET_ITEM(list, 0, pid);
        int rc = PyDict_SetItem(by, at, list);
        Py_DECREF(list);
        return rc;
    }
    return PyList_Append(got, pid);
}

static PyObject *py_follows(PyObject *self, PyObject *args) {
    PyObject *transfers, *busy, *ids;
    if (!PyArg_ParseTuple(args, "O!OO!", &PyTuple_Type, &transfers, &busy, &PyDict_Type, &ids)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(transfers);
    PyObject *ends = NULL, *after = NULL, *busy_fast = NULL, *out = NULL;
    Start *order = PyMem_Malloc((n ? n : 1) * sizeof(Start));
    PyObject **at_link = NULL;
    if (order == NULL) return PyErr_NoMemory();
    if ((ends = PyDict_New()) == NULL) goto done;
    if ((busy_fast = PySequence_Fast(busy, "busy must be a sequence")) == NULL) goto done;
    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(busy_fast); b++) {
        PyObject *item = PySequence_Fast_GET_ITEM(busy_fast, b);
        PyObject *fid, *links, *end;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "busy: (id, links, end) each");
            goto done;
        }
        fid = PyTuple_GET_ITEM(item, 0);
        links = PyTuple_GET_ITEM(item, 1);
        end = PyTuple_GET_ITEM(item, 2);
        PyObject *lf = PySequence_Fast(links, "busy: links must be a sequence");
        if (lf == NULL) goto done;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(lf); k++) {
            PyObject *by = NULL;
            if (add_end(ends, PySequence_Fast_GET_ITEM(lf, k), end, fid, &by) < 0) {
                Py_DECREF(lf);
                goto done;
            }
        }
        Py_DECREF(lf);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = PyObject_GetAttr(PyTuple_GET_ITEM(transfers, i), str_start);
        if (st == NULL) goto done;
        order[i].start = PyFloat_AsDouble(st);
        Py_DECREF(st);
        if (order[i].start == -1.0 && PyErr_Occurred()) goto done;
        order[i].i = i;
    }
    qsort(order, n, sizeof(Start), start_cmp);
    if ((after = PyList_New(n)) == NULL) goto done;
    at_link = PyMem_Malloc(MAX_LINKS * sizeof(PyObject *));
    if (at_link == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        Py_ssize_t i = order[q].i;
        PyObject *t = PyTuple_GET_ITEM(transfers, i);
        PyObject *path = PyObject_GetAttr(t, str_path);
        if (path == NULL) goto done;
        if (!PyTuple_CheckExact(path)) {
            Py_DECREF(path);
            PyErr_SetString(PyExc_TypeError, "follows: a path must be a tuple");
            goto done;
        }
        Py_ssize_t nh = PyTuple_GET_SIZE(path);
        if (nh < 2) {
            Py_DECREF(path);
            Py_INCREF(empty_tuple);
            PyList_SET_ITEM(after, i, empty_tuple);
            continue;
        }
        if (nh - 1 > MAX_LINKS) {
            Py_DECREF(path);
            PyErr_SetString(PyExc_ValueError, "follows: path too long");
            goto done;
        }
        PyObject *start = PyObject_GetAttr(t, str_start);
        PyObject *pid = start == NULL ? NULL : PyObject_GetAttr(t, str_payload_id);
        PyObject *end = pid == NULL ? NULL : PyObject_GetAttr(t, str_end);
        PyObject *found = end == NULL ? NULL : PySet_New(NULL);
        int ok = found != NULL;
        for (Py_ssize_t k = 0; ok && k + 1 < nh; k++) { /* at_link = [ends[link] for link in t.links] */
            PyObject *link = PyTuple_Pack(2, PyTuple_GET_ITEM(path, k), PyTuple_GET_ITEM(path, k + 1));
            PyObject *by = NULL;
            if (link == NULL) {
                ok = 0;
                break;
            }
            by = PyDict_GetItemWithError(ends, link);
            if (by == NULL) {
                if (PyErr_Occurred() || (by = PyDict_New()) == NULL) {
                    ok = 0;
                } else {
                    ok = PyDict_SetItem(ends, link, by) == 0;
                    Py_DECREF(by);
                }
            }
            Py_DECREF(link);
            at_link[k] = by;
            if (!ok) break;
            PyObject *got = PyDict_GetItemWithError(by, start);
            if (got != NULL) {
                if (!PyList_CheckExact(got)) {
                    PyErr_SetString(PyExc_TypeError, "follows: ends must be lists");
                    ok = 0;
                }
                for (Py_ssize_t g = 0; ok && g < PyList_GET_SIZE(got); g++)
                    if (PySet_Add(found, PyList_GET_ITEM(got, g)) < 0) ok = 0;
            } else if (PyErr_Occurred()) {
                ok = 0;
            }
        }
        PyObject *deps = NULL;
        if (ok && PySet_Discard(found, pid) < 0) ok = 0;
        if (ok) {
            Py_ssize_t nf = PySet_GET_SIZE(found);
            PyObject *list = nf ? PySequence_List(found) : NULL;
            if (nf && list == NULL) ok = 0;
            for (Py_ssize_t k = 0; ok && k < nf; k++) { /* ids.get(p, p) */
                PyObject *p = PyList_GET_ITEM(list, k);
                PyObject *named = PyDict_GetItemWithError(ids, p);
                if (named == NULL && PyErr_Occurred()) {
                    ok = 0;
                } else if (named != NULL) {
                    Py_INCREF(named);
                    PyList_SetItem(list, k, named);
                }
            }
            if (ok && nf > 1 && PyList_Sort(list) < 0) ok = 0;
            if (ok) deps = nf ? PyList_AsTuple(list) : (Py_INCREF(empty_tuple), empty_tuple);
            Py_XDECREF(list);
            if (deps == NULL) ok = 0;
        }
        for (Py_ssize_t k = 0; ok && k + 1 < nh; k++) {
            PyObject *by = at_link[k];
            if (add_end(ends, NULL, end, pid, &by) < 0) ok = 0;
        }
        Py_XDECREF(path);
        Py_XDECREF(start);
        Py_XDECREF(pid);
        Py_XDECREF(end);
        Py_XDECREF(found);
        if (!ok) {
            Py_XDECREF(deps);
            goto done;
        }
        PyList_SET_ITEM(after, i, deps);
    }
    out = after;
    after = NULL;
done:
    PyMem_Free(order);
    PyMem_Free(at_link);
    Py_XDECREF(ends);
    Py_XDECREF(busy_fast);
    Py_XDECREF(after);
    return out;
}

/* ------------------------------------------------------------------ trees._build */

typedef struct {
    PyObject *top, *rank, *host_of, *prefix, *nodes, *parent, *summing, *node_cls, *node_fields;
} Sum;

static Py_ssize_t rank_of(PyObject *rank, PyObject *h) {
    PyObject *r = PyDict_GetItemWithError(rank, h);
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    return PyLong_AsSsize_t(r);
}

/* trees._sum: the aggregate of `members` (a list, copied) at the best host below `point`; its id */
static PyObject *sum_at(Sum *S, PyObject *point, PyObject *members) {
    PyObject *tt = PyDict_GetItemWithError(S->top, point);
    if (tt == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, point);
        return NULL;
    }
    if (!PyTuple_Check(tt) || PyTuple_GET_SIZE(tt) != 2 || !PyList_Check(PyTuple_GET_ITEM(tt, 0))) {
        PyErr_SetString(PyExc_TypeError, "build: top[x] must be (list, set)");
        return NULL;
    }
    PyObject *tier = PyTuple_GET_ITEM(tt, 0), *fastest = PyTuple_GET_ITEM(tt, 1);
    PyObject *busy = PyDict_GetItemWithError(S->summing, point);
    if (busy == NULL) {
        if (PyErr_Occurred() || (busy = PySet_New(NULL)) == NULL) return NULL;
        int rc = PyDict_SetItem(S->summing, point, busy);
        Py_DECREF(busy);
        if (rc < 0) return NULL;
    }
    PyObject *local = PySet_New(NULL);
    if (local == NULL) return NULL;
    Py_ssize_t nm = PyList_GET_SIZE(members);
    for (Py_ssize_t k = 0; k < nm; k++) {
        PyObject *h = PyDict_GetItemWithError(S->host_of, PyList_GET_ITEM(members, k));
        if (h == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(members, k));
            Py_DECREF(local);
            return NULL;
        }
        int in = PySet_Contains(fastest, h);
        if (in < 0 || (in && PySet_Add(local, h) < 0)) {
            Py_DECREF(local);
            return NULL;
        }
    }
    PyObject *agg = NULL; /* borrowed */
    Py_ssize_t nl = PySet_GET_SIZE(local);
    PyObject *ranked = NULL;
    if (nl == 0) {
        if (PyList_GET_SIZE(tier) == 0) {
            PyErr_SetString(PyExc_IndexError, "build: no host in the tier");
            Py_DECREF(local);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(tier) && agg == NULL; k++) {
            int b = PySet_Contains(busy, PyList_GET_ITEM(tier, k));
            if (b < 0) {
                Py_DECREF(local);
                return NULL;
            }
            if (!b) agg = PyList_GET_ITEM(tier, k);
        }
        if (agg == NULL) agg = PyList_GET_ITEM(tier, 0);
    } else {
        /* sorted(local, key=rank): ranks are unique, so by (rank, host) */
        ranked = PyList_New(0);
        if (ranked == NULL) {
            Py_DECREF(local);
            return NULL;
        }
        Py_ssize_t pos = 0;
        PyObject *h;
        Py_hash_t hash;
        while (_PySet_NextEntry(local, &pos, &h, &hash)) {
            Py_ssize_t r = rank_of(S->rank, h);
            if (r < 0 && PyErr_Occurred()) goto fail_ranked;
            PyObject *ro = PyLong_FromSsize_t(r);
            PyObject *pair = ro == NULL ? NULL : PyTuple_Pack(2, ro, h);
            Py_XDECREF(ro);
            if (pair == NULL || PyList_Append(ranked, pair) < 0) {
                Py_XDECREF(pair);
                goto fail_ranked;
            }
            Py_DECREF(pair);
        }
        if (PyList_Sort(ranked) < 0) goto fail_ranked;
        if (nl == 1) {
            agg = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, 0), 1);
        } else {
            for (Py_ssize_t k = 0; k < nl && agg == NULL; k++) {
                PyObject *c = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, k), 1);
                int b = PySet_Contains(busy, c);
                if (b < 0) goto fail_ranked;
                if (!b) agg = c;
            }
            if (agg == NULL) agg = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, 0), 1);
        }
    }
    Py_INCREF(agg); /* keep it past ranked and local */
    Py_XDECREF(ranked);
    Py_DECREF(local);
    PyObject *aid = NULL, *copy = NULL, *node = NULL;
    if (PySet_Add(busy, agg) < 0) goto fail;
    aid = PyUnicode_FromFormat("agg:%U:%zd", S->prefix, PyDict_GET_SIZE(S->nodes));
    if (aid == NULL) goto fail;
    if ((copy = PyList_GetSlice(members, 0, nm)) == NULL) goto fail;
    PyObject *values[4] = {point, agg, copy, Py_None};
    if ((node = make_instance(S->node_cls, S->node_fields, values, S->node_fields == Py_None ? 3 : 4)) == NULL)
        goto fail;
    if (PyDict_SetItem(S->nodes, aid, node) < 0) goto fail;
    for (Py_ssize_t k = 0; k < nm; k++)
        if (PyDict_SetItem(S->parent, PyList_GET_ITEM(members, k), aid) < 0) goto fail;
    if (PyDict_SetItem(S->host_of, aid, agg) < 0) goto fail;
    Py_DECREF(agg);
    Py_DECREF(copy);
    Py_DECREF(node);
    return aid;
fail:
    Py_DECREF(agg);
    Py_XDECREF(aid);
    Py_XDECREF(copy);
    Py_XDECREF(node);
    return NULL;
fail_ranked:
    Py_XDECREF(ranked);
    Py_DECREF(local);
    return NULL;
}

static PyObject *list_extend(PyObject *dst, PyObject *src) {
    Py_ssize_t n = PyList_GET_SIZE(dst);
    if (PyList_SetSlice(dst, n, n, src) < 0) return NULL;
    return dst;
}

static PyObject *py_build(PyObject *self, PyObject *args) {
    PyObject *groups, *tdepth, *index, *below, *points, *bypass;
    Py_ssize_t fan_in;
    Sum S;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!UO!nOO", &PyDict_Type, &groups, &PyDict_Type, &tdepth, &PyDict_Type,
                          &index, &PyDict_Type, &below, &PyDict_Type, &S.top, &PyDict_Type, &S.rank, &PyDict_Type,
                          &S.host_of, &PyFrozenSet_Type, &points, &S.prefix, &PyDict_Type, &bypass, &fan_in,
                          &S.node_cls, &S.node_fields))
        return NULL;
    PyObject *carried = PyDict_New(), *up = PyDict_New(), *depth = PyDict_New(), *firsts = PyDict_New();
    PyObject *out = NULL, *keys = NULL;
    S.nodes = PyDict_New();
    S.parent = PyDict_New();
    S.summing = PyDict_New();
    S.host_of = PyDict_Copy(S.host_of);
    if (!carried || !up || !depth || !firsts || !S.nodes || !S.parent || !S.summing || !S.host_of) goto done;
    {
        Py_ssize_t it = 0;
        PyObject *on, *uids;
        while (PyDict_Next(groups, &it, &on, &uids)) {
            if (!PyTuple_Check(on)) {
                PyErr_SetString(PyExc_TypeError, "build: group keys must be tuples");
                goto done;
            }
            PyObject *prev = NULL, *first = NULL; /* borrowed */
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(on); k++) {
                PyObject *x = PyTuple_GET_ITEM(on, k);
                int in = PySet_Contains(points, x);
                if (in < 0) goto done;
                if (!in) continue;
                int has = PyDict_Contains(carried, x);
                if (has < 0) goto done;
                if (!has) {
                    PyObject *l = PyList_New(0);
                    if (l == NULL || PyDict_SetItem(carried, x, l) < 0) {
                        Py_XDECREF(l);
                        goto done;
                    }
                    Py_DECREF(l);
                    PyObject *d = PyDict_GetItemWithError(tdepth, x);
                    if (d == NULL) {
                        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, x);
                        goto done;
                    }
                    if (PyDict_SetItem(depth, x, d) < 0) goto done;
                }
                if (prev != NULL && PyDict_SetItem(up, prev, x) < 0) goto done;
                if (first == NULL) first = x;
                prev = x;
            }
            if (first == NULL) continue;
            if (PyDict_SetDefault(up, prev, Py_None) == NULL) goto done;
            PyObject *lists = PyDict_GetItemWithError(firsts, first);
            if (lists == NULL) {
                if (PyErr_Occurred() || (lists = PyList_New(0)) == NULL) goto done;
                int rc = PyDict_SetItem(firsts, first, lists);
                Py_DECREF(lists);
                if (rc < 0) goto done;
            }
            if (PyList_Append(lists, uids) < 0) goto done;
        }
    }
    {
        Py_ssize_t it = 0;
        PyObject *x, *lists;
        while (PyDict_Next(firsts, &it, &x, &lists)) {
            PyObject *l;
            if (PyList_GET_SIZE(lists) == 1) {
                l = PySequence_List(PyList_GET_ITEM(lists, 0));
            } else { /* sorted(chain(*lists), key=index): indices are unique, so by (index, id) */
                PyObject *pairs = PyList_New(0);
                if (pairs == NULL) goto done;
                for (Py_ssize_t a = 0; a < PyList_GET_SIZE(lists); a++) {
                    PyObject *f = PySequence_Fast(PyList_GET_ITEM(lists, a), "build: updates must be a sequence");
                    if (f == NULL) {
                        Py_DECREF(pairs);
                        goto done;
                    }
                    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(f); b++) {
                        PyObject *uid = PySequence_Fast_GET_ITEM(f, b);
                        PyObject *ix = PyDict_GetItemWithError(index, uid);
                        PyObject *pair = ix == NULL ? NULL : PyTuple_Pack(2, ix, uid);
                        if (ix == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, uid);
                        if (pair == NULL || PyList_Append(pairs, pair) < 0) {
                            Py_XDECREF(pair);
                            Py_DECREF(f);
                            Py_DECREF(pairs);
                            goto done;
                        }
                        Py_DECREF(pair);
                    }
                    Py_DECREF(f);
                }
                if (PyList_Sort(pairs) < 0) {
                    Py_DECREF(pairs);
                    goto done;
                }
                l = PyList_New(PyList_GET_SIZE(pairs));
                for (Py_ssize_t a = 0; l != NULL && a < PyList_GET_SIZE(pairs); a++) {
                    PyObject *uid = PyTuple_GET_ITEM(PyList_GET_ITEM(pairs, a), 1);
                    Py_INCREF(uid);
                    PyList_SET_ITEM(l, a, uid);
                }
                Py_DECREF(pairs);
            }
            if (l == NULL || PyDict_SetItem(carried, x, l) < 0) {
                Py_XDECREF(l);
                goto done;
            }
            Py_DECREF(l);
        }
    }
    /* for x in sorted(carried, key=lambda x: (-depth[x], x)) */
    keys = PyList_New(0);
    if (keys == NULL) goto done;
    {
        Py_ssize_t it = 0;
        PyObject *x, *l;
        while (PyDict_Next(carried, &it, &x, &l)) {
            PyObject *d = PyDict_GetItem(depth, x);
            PyObject *neg = d == NULL ? NULL : PyNumber_Negative(d);
            PyObject *pair = neg == NULL ? NULL : PyTuple_Pack(2, neg, x);
            Py_XDECREF(neg);
            if (pair == NULL || PyList_Append(keys, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
        }
    }
    if (PyList_Sort(keys) < 0) goto done;
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(keys); q++) {
        PyObject *x = PyTuple_GET_ITEM(PyList_GET_ITEM(keys, q), 1);
        PyObject *payloads = PyDict_GetItem(carried, x);
        PyObject *nxt = PyDict_GetItem(up, x);
        PyObject *nxt_list = NULL;
        if (nxt != NULL && nxt != Py_None) nxt_list = PyDict_GetItem(carried, nxt);
        Py_ssize_t np = PyList_GET_SIZE(payloads), skip = 0;
        PyObject *b = PyDict_GetItemWithError(bypass, x);
        if (b == NULL && PyErr_Occurred()) goto done;
        if (b != NULL) {
            skip = PyLong_AsSsize_t(b);
            if (skip == -1 && PyErr_Occurred()) goto done;
        }
        if (skip > np) skip = np;
        PyObject *cands = PyDict_GetItemWithError(below, x);
        if (cands == NULL && PyErr_Occurred()) goto done;
        Py_ssize_t nc = cands == NULL ? 0 : PyObject_Length(cands);
        if (nc < 0) goto done;
        if (np - skip < 2 || nc == 0) {
            if (nxt_list != NULL && list_extend(nxt_list, payloads) == NULL) goto done;
            continue;
        }
        PyObject *summed = PyList_GetSlice(payloads, skip, np);
        if (summed == NULL) goto done;
        if (nxt_list != NULL) {
            PyObject *head = PyList_GetSlice(payloads, 0, skip);
            if (head == NULL || list_extend(nxt_list, head) == NULL) {
                Py_XDECREF(head);
                Py_DECREF(summed);
                goto done;
            }
            Py_DECREF(head);
        }
        while (fan_in && PyList_GET_SIZE(summed) > fan_in) { /* too many for one NIC: sum in groups first */
            PyObject *next = PyList_New(0);
            if (next == NULL) {
                Py_DECREF(summed);
                goto done;
            }
            Py_ssize_t ns = PyList_GET_SIZE(summed);
            for (Py_ssize_t a = 0; a < ns; a += fan_in) {
                Py_ssize_t e = a + fan_in < ns ? a + fan_in : ns;
                PyObject *group = PyList_GetSlice(summed, a, e);
                PyObject *aid = NULL;
                int ok = group != NULL;
                if (ok && e - a < 2) {
                    ok = list_extend(next, group) != NULL;
                } else if (ok) {
                    aid = sum_at(&S, x, group);
                    ok = aid != NULL && PyList_Append(next, aid) == 0;
                }
                Py_XDECREF(group);
                Py_XDECREF(aid);
                if (!ok) {
                    Py_DECREF(next);
                    Py_DECREF(summed);
                    goto done;
                }
            }
            Py_SETREF(summed, next);
        }
        PyObject *aid = sum_at(&S, x, summed);
        Py_DECREF(summed);
        if (aid == NULL) goto done;
        int rc = nxt_list != NULL ? PyList_Append(nxt_list, aid) : 0;
        Py_DECREF(aid);
        if (rc < 0) goto done;
    }
    {
        Py_ssize_t it = 0;
        PyObject *aid, *node;
        while (PyDict_Next(S.nodes, &it, &aid, &node)) { /* node.parent = parent.get(aid) */
            PyObject *p = PyDict_GetItem(S.parent, aid);
            if (PyObject_SetAttr(node, str_parent, p == NULL ? Py_None : p) < 0) goto done;
        }
    }
    out = PyTuple_Pack(2, S.nodes, S.parent);
done:
    Py_XDECREF(carried);
    Py_XDECREF(up);
    Py_XDECREF(depth);
    Py_XDECREF(firsts);
    Py_XDECREF(keys);
    Py_XDECREF(S.nodes);
    Py_XDECREF(S.parent);
    Py_XDECREF(S.summing);
    Py_XDECREF(S.host_of);
    return out;
}

static PyMethodDef methods[] = {
    {"transfer", py_transfer, METH_VARARGS, "Timelines.transfer's walk and reservation (see the module doc)."},
    {"reserve_tree", py_reserve_tree, METH_VARARGS, "tree_cost.reserve's loop (see the module doc)."},
    {"follows", py_follows, METH_VARARGS, "schedule_to_decision's `after` of each transfer (see the module doc)."},
    {"build", py_build, METH_VARARGS, "trees._build (see the module doc)."},
    {"estimate", py_estimate, METH_VARARGS, "tree_cost.estimate's loop (see the module doc)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plan_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan_native(void) {
    str_times = PyUnicode_InternFromString("times");
    str_residual = PyUnicode_InternFromString("residual");
    str_eps = PyUnicode_InternFromString("eps");
    str_aggregator = PyUnicode_InternFromString("aggregator");
    str_parent = PyUnicode_InternFromString("parent");
    str_members = PyUnicode_InternFromString("members");
    str_free = PyUnicode_InternFromString("free");
    str_per = PyUnicode_InternFromString("per");
    str_grow = PyUnicode_InternFromString("sync");
    str_hosts = PyUnicode_InternFromString("hosts");
    str_dsts = PyUnicode_InternFromString("dsts");
    str_host = PyUnicode_InternFromString("host");
    str_dst_m = PyUnicode_InternFromString("_dst");
    str_pair_ids = PyUnicode_InternFromString("pair_ids");
    str_path = PyUnicode_InternFromString("path");
    str_up = PyUnicode_InternFromString("up");
    str_pos = PyUnicode_InternFromString("pos");
    str_down = PyUnicode_InternFromString("down");
    str_server = PyUnicode_InternFromString("server");
    str_tree = PyUnicode_InternFromString("_tree");
    empty_tuple = PyTuple_New(0);
    str_walks = PyUnicode_InternFromString("walks");
    str_back = PyUnicode_InternFromString("back");
    str_pair_path = PyUnicode_InternFromString("pair_path");
    str_links = PyUnicode_InternFromString("_links");
    str_link = PyUnicode_InternFromString("link");
    str_transfer = PyUnicode_InternFromString("transfer");
    str_end = PyUnicode_InternFromString("end");
    str_update_id = PyUnicode_InternFromString("update_id");
    str_src = PyUnicode_InternFromString("src");
    a_transfer = PyUnicode_InternFromString("a transfer");
    str_start = PyUnicode_InternFromString("start");
    str_payload_id = PyUnicode_InternFromString("payload_id");
    if (!str_start || !str_payload_id) return NULL;
    if (!str_walks || !str_back || !str_pair_path || !str_links || !str_link || !str_transfer || !str_end ||
        !str_update_id || !str_src || !a_transfer)
        return NULL;
    if (!str_aggregator || !str_parent || !str_members || !str_free || !str_per || !str_grow || !str_hosts ||
        !str_dsts || !str_host || !str_dst_m || !str_pair_ids || !str_path || !str_up || !str_pos || !str_down ||
        !str_server || !str_tree || !empty_tuple)
        return NULL;
    fmt_over = PyUnicode_FromString("reserving {:g} B/s for {} at t={:g} exceeds the residual {:g} B/s");
    if (!str_times || !str_residual || !str_eps || !fmt_over) return NULL;
    return PyModule_Create(&module);
}
