/* The STF planner's links in C (see plan_stf.c): timelines read in place, walks, bounds. */
#include "plan_stf.h"

#define FL(list, i) PyFloat_AS_DOUBLE(PyList_GET_ITEM((list), (i)))

int stf_grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return 0;
    Py_ssize_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = PyMem_Realloc(*p, (size_t)n * size);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    *cap = n;
    return 0;
}

/* read a LinkTimeline's lists into `l` (lane_of): 1, 0 (not float lists), -1 */
static int read_timeline(Lnk *l, PyObject *tl) {
    Lane lane;
    if (lane_of(tl, &lane) < 0) return -1;
    l->eps = lane.eps;
    if (!all_floats(lane.times) || !all_floats(lane.residual) || PyList_GET_SIZE(lane.times) == 0) return 0;
    l->times = lane.times; /* the timeline keeps its lists for the whole run (changed, never replaced) */
    l->residual = lane.residual;
    return 1;
}

/* a link seen for the first time: its timeline if the Timelines has one (or a capacity
   profile, then made now), else its graph capacity */
static int init_link(STF *st, Lnk *l, PyObject *link, Py_ssize_t num) {
    memset(l, 0, sizeof(*l));
    l->modified = -1;
    l->live = -1;
    Py_INCREF(link);
    l->key = link;
    PyObject *tl = PyDict_GetItemWithError(st->tls_links, link);
    if (tl == NULL && PyErr_Occurred()) return -1;
    if (tl == NULL) {
        int prof = PyDict_CheckExact(st->profiles) && PyDict_GET_SIZE(st->profiles) == 0
                       ? 0
                       : PySequence_Contains(st->profiles, link);
        if (prof < 0) return -1;
        /* the book's number's capacity, read from the graph once while its capacities hold */
        PyObject *cap = prof || num < 0 ? NULL : PyList_GET_ITEM(st->cap_cache, num);
        if (cap == Py_None) cap = NULL;
        if (cap == NULL) {
            PyObject *data = NULL;
            if (!prof && PyTuple_CheckExact(link) && PyTuple_GET_SIZE(link) == 2) {
                PyObject *nbrs = PyDict_GetItemWithError(st->succ, PyTuple_GET_ITEM(link, 0));
                if (nbrs == NULL && PyErr_Occurred()) return -1;
                data = nbrs ? PyDict_GetItemWithError(nbrs, PyTuple_GET_ITEM(link, 1)) : NULL;
                if (data == NULL && PyErr_Occurred()) return -1;
            }
            if (data == NULL) return stf_realize(st, l - st->l); /* tls.link makes it (or raises) */
            cap = PyDict_GetItemWithError(data, s_capacity);
            if (cap == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "capacity");
                return -1;
            }
            if (num >= 0 && PyList_SetItem(st->cap_cache, num, Py_NewRef(cap)) < 0) return -1;
        }
        l->cap = PyFloat_AsDouble(cap);
        if (l->cap == -1.0 && PyErr_Occurred()) return -1;
        l->eps = st->eps * l->cap; /* LinkTimeline: EPS * float(capacity) */
        l->has_cap = 1;
        return 0;
    }
    int ok = read_timeline(l, tl);
    if (ok < 0) return -1;
    if (ok == 0) {
        PyErr_SetString(PyExc_TypeError, "a link timeline's times and residual must be lists of floats");
        return -1;
    }
    return 0;
}

Py_ssize_t stf_link(STF *st, PyObject *link) {
    PyObject *ix = PyDict_GetItemWithError(st->link_ix, link);
    if (ix != NULL) return PyLong_AsSsize_t(ix);
    if (PyErr_Occurred()) return -1;
    if (stf_grow((void **)&st->l, &st->lcap, st->nl + 1, sizeof(Lnk)) < 0) return -1;
    Py_ssize_t li = st->nl++;
    if (init_link(st, &st->l[li], link, -1) < 0) {
        st->nl--;
        Py_CLEAR(st->l[li].key);
        return -1;
    }
    PyObject *v = PyLong_FromSsize_t(li);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(st->link_ix, link, v);
    Py_DECREF(v);
    return rc < 0 ? -1 : li;
}

/* Timelines.link(link) for a link of capacity l->cap and no profile: the lists of
   LinkTimeline(cap, start) made here, held by the link (l->own) and queued for stf_flush,
   which makes the timeline around them (as its __init__ sets its slots) into the Timelines'
   dict before anything else can read it there. The lists and the timeline are left out of the
   cyclic collector: they hold floats only, so they are never part of a cycle, and a decision
   makes hundreds of them (issue 24). 1: made, 0: the origin is not a float or the class not a
   type (make_timeline then), -1: error. */
static int new_timeline(STF *st, Lnk *l) {
    if (st->t0_o == NULL && (st->t0_o = PyObject_GetAttrString(st->tls, "_start")) == NULL) return -1;
    if (!PyFloat_CheckExact(st->t0_o) || !PyType_Check(st->timeline_cls)) return 0;
    if (stf_grow((void **)&st->made, &st->madecap, st->nmade + 1, sizeof(Py_ssize_t)) < 0) return -1;
    PyObject *times = PyList_New(1), *residual = times ? PyList_New(1) : NULL;
    PyObject *cap = residual ? PyFloat_FromDouble(l->cap) : NULL;
    if (cap == NULL) {
        Py_XDECREF(times);
        Py_XDECREF(residual);
        return -1;
    }
    PyList_SET_ITEM(times, 0, Py_NewRef(st->t0_o));
    PyList_SET_ITEM(residual, 0, cap);
    PyObject_GC_UnTrack(times);
    PyObject_GC_UnTrack(residual);
    l->times = times;
    l->residual = residual;
    l->own = 1;
    st->made[st->nmade++] = l - st->l;
    return 1;
}

int stf_flush(STF *st) {
    Py_ssize_t n = st->nmade;
    st->nmade = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Lnk *l = &st->l[st->made[k]];
        if (l->key == NULL || l->times == NULL) continue; /* (a link given up on an error) */
        PyObject *obj = PyBaseObject_Type.tp_new((PyTypeObject *)st->timeline_cls, empty_tuple, NULL);
        PyObject *eps = obj ? PyFloat_FromDouble(l->eps) : NULL;
        int rc = -1;
        if (eps != NULL && PyObject_SetAttr(obj, str_times, l->times) == 0 &&
            PyObject_SetAttr(obj, str_residual, l->residual) == 0 && PyObject_SetAttr(obj, str_eps, eps) == 0 &&
            PyDict_SetItem(st->tls_links, l->key, obj) == 0)
            rc = 0;
        if (obj != NULL && PyObject_GC_IsTracked(obj)) PyObject_GC_UnTrack(obj);
        Py_XDECREF(obj);
        Py_XDECREF(eps);
        if (rc < 0) return -1;
    }
    return 0;
}

int stf_realize(STF *st, Py_ssize_t li) {
    Lnk *l = &st->l[li];
    if (l->times != NULL) return 0;
    int made = l->has_cap ? new_timeline(st, l) : 0;
    if (made != 0) return made < 0 ? -1 : 0; /* made here: read as made */
    if (stf_flush(st) < 0) return -1; /* (Timelines.link adds to the dict: after those made before) */
    if (make_timeline(st->tls, st->tls_links, l->key, st->timeline_cls, st->eps) < 0) return -1;
    PyObject *tl = PyDict_GetItemWithError(st->tls_links, l->key); /* the Timelines holds it */
    if (tl == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "stf_run: Timelines.link made no timeline");
        return -1;
    }
    int ok = read_timeline(l, tl);
    if (ok == 0) PyErr_SetString(PyExc_TypeError, "a link timeline's times and residual must be lists of floats");
    return ok == 1 ? 0 : -1;
}

/* stf_links_of by the book's link numbers: its links tuple and numbers, each link's slot
   made on first use; 0 or -1 */
static int links_by_number(STF *st, Py_ssize_t ui) {
    Upd *u = &st->u[ui];
    PyObject *row = PyDict_GetItemWithError(st->ix_of, u->uid);
    if (row == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, u->uid);
        return -1;
    }
    PyObject *links = PyTuple_CheckExact(row) && PyTuple_GET_SIZE(row) == 6 ? PyTuple_GET_ITEM(row, 0) : NULL;
    PyObject *nums = links ? PyTuple_GET_ITEM(row, 1) : NULL;
    if (links == NULL || !PyTuple_CheckExact(links) || !PyTuple_CheckExact(nums) ||
        PyTuple_GET_SIZE(nums) != PyTuple_GET_SIZE(links)) {
        PyErr_SetString(PyExc_TypeError,
                        "stf_run: an update's row must be (links, their numbers, src, dst, bytes, server)");
        return -1;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(links);
    if (k > MAX_LINKS) {
        PyErr_SetString(PyExc_ValueError, "a path of more than 64 links");
        return -1;
    }
    if (stf_grow((void **)&st->pool, &st->poolcap, st->npool + k, sizeof(Py_ssize_t)) < 0) return -1;
    Py_ssize_t l0 = st->npool;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t num = PyLong_AsSsize_t(PyTuple_GET_ITEM(nums, i));
        if (num == -1 && PyErr_Occurred()) return -1;
        if (num < 0 || num >= st->nbook) {
            PyErr_SetString(PyExc_IndexError, "stf_run: a link number out of range");
            return -1;
        }
        Py_ssize_t li = (Py_ssize_t)st->slot_of[num] - 1;
        if (li < 0) { /* its slot made now, after the others */
            if (st->nl >= INT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "stf_run: too many links");
                return -1;
            }
            if (stf_grow((void **)&st->l, &st->lcap, st->nl + 1, sizeof(Lnk)) < 0) return -1;
            li = st->nl++;
            if (init_link(st, &st->l[li], PyList_GET_ITEM(st->link_list, num), num) < 0) {
                st->nl--;
                Py_CLEAR(st->l[li].key);
                return -1;
            }
            st->slot_of[num] = (int32_t)(li + 1);
        }
        st->pool[l0 + i] = li;
    }
    st->npool += k;
    u = &st->u[ui];
    u->links = Py_NewRef(links);
    u->row = Py_NewRef(row);
    u->l0 = l0;
    u->nl = k;
    return 0;
}

Py_ssize_t *stf_links_of(STF *st, Py_ssize_t ui, Py_ssize_t *n) {
    Upd *u = &st->u[ui];
    if (u->nl < 0 && st->ix_of != NULL) {
        if (links_by_number(st, ui) < 0) return NULL;
        u = &st->u[ui];
    }
    if (u->nl < 0) {
        PyObject *links = PyDict_GetItemWithError(st->links_of, u->uid);
        if (links == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, u->uid);
            return NULL;
        }
        links = PySequence_Tuple(links);
        if (links == NULL) return NULL;
        Py_ssize_t k = PyTuple_GET_SIZE(links);
        if (k > MAX_LINKS) {
            Py_DECREF(links);
            PyErr_SetString(PyExc_ValueError, "a path of more than 64 links");
            return NULL;
        }
        if (stf_grow((void **)&st->pool, &st->poolcap, st->npool + k, sizeof(Py_ssize_t)) < 0) {
            Py_DECREF(links);
            return NULL;
        }
        Py_ssize_t l0 = st->npool;
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_ssize_t li = stf_link(st, PyTuple_GET_ITEM(links, i));
            if (li < 0) {
                Py_DECREF(links);
                return NULL;
            }
            st->pool[l0 + i] = li;
        }
        st->npool += k;
        u = &st->u[ui];
        u->links = links;
        u->l0 = l0;
        u->nl = k;
    }
    *n = u->nl;
    static Py_ssize_t none[1]; /* no links (and maybe no pool yet): not NULL, which is an error */
    return u->nl ? st->pool + u->l0 : none;
}

static inline Py_ssize_t ln_len(const Lnk *l) { return l->times ? PyList_GET_SIZE(l->times) : 1; }
static inline double ln_t(const STF *st, const Lnk *l, Py_ssize_t i) { return l->times ? FL(l->times, i) : st->t0; }
static inline double ln_r(const Lnk *l, Py_ssize_t i) { return l->times ? FL(l->residual, i) : l->cap; }

/* bisect.bisect_right(times, x, lo) */
static Py_ssize_t ln_bisect_right(const STF *st, const Lnk *l, double x, Py_ssize_t lo) {
    Py_ssize_t hi = ln_len(l);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < ln_t(st, l, mid))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* bisect.bisect_left(times, x, lo) */
static Py_ssize_t ln_bisect_left(const STF *st, const Lnk *l, double x, Py_ssize_t lo) {
    Py_ssize_t hi = ln_len(l);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (ln_t(st, l, mid) < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

double stf_free_from(STF *st, Py_ssize_t li) {
    Lnk *l = &st->l[li];
    if (l->free_ok) return l->free;
    Py_ssize_t n = ln_len(l), i = ln_bisect_right(st, l, st->now, 0) - 1;
    if (i < 0) i = 0;
    while (i < n && ln_r(l, i) <= l->eps) i++;
    double t = INFINITY;
    if (i < n) {
        t = ln_t(st, l, i);
        if (st->now > t) t = st->now; /* max(times[i], now) */
    }
    l->free = t;
    l->free_ok = 1;
    return t;
}

double stf_peak(STF *st, Py_ssize_t li) {
    Lnk *l = &st->l[li];
    if (l->peak_ok) return l->peak;
    Py_ssize_t n = ln_len(l), i = ln_bisect_right(st, l, st->now, 0) - 1;
    if (i < 0) i = 0;
    double p = ln_r(l, i);
    for (Py_ssize_t k = i + 1; k < n; k++) {
        double r = ln_r(l, k);
        if (r > p) p = r;
    }
    l->peak = p;
    l->peak_ok = 1;
    return p;
}

double stf_min_over(STF *st, Py_ssize_t li, double lo, double hi) {
    Lnk *l = &st->l[li];
    Py_ssize_t i = ln_bisect_right(st, l, lo, 0) - 1;
    if (i < 0) i = 0;
    Py_ssize_t j = ln_bisect_left(st, l, hi, i + 1);
    double m = ln_r(l, i);
    for (Py_ssize_t k = i + 1; k < j; k++) {
        double r = ln_r(l, k);
        if (r < m) m = r;
    }
    return m;
}

/* append the piece (t, hi, rate) to st->scratch, merged with the last one as _walk merges */
static int piece(STF *st, double t, double hi, double rate) {
    Py_ssize_t n = st->nscratch;
    if (n > 0 && st->scratch[3 * n - 1] == rate && st->scratch[3 * n - 2] == t) {
        st->scratch[3 * n - 2] = hi;
        return 0;
    }
    Py_ssize_t cap3 = st->scratchcap;
    if (stf_grow((void **)&st->scratch, &cap3, 3 * (n + 1), sizeof(double)) < 0) return -1;
    st->scratchcap = cap3;
    st->scratch[3 * n] = t;
    st->scratch[3 * n + 1] = hi;
    st->scratch[3 * n + 2] = rate;
    st->nscratch = n + 1;
    return 0;
}

int stf_walk(STF *st, Py_ssize_t ui, double nbytes, double ready, double *end) {
    Py_ssize_t nl;
    Py_ssize_t *lk = stf_links_of(st, ui, &nl);
    if (lk == NULL) return -1;
    st->nscratch = 0;
    if (nl == 0 || nbytes <= 0) {
        *end = ready;
        return 1;
    }
    double cap = INFINITY;
    Lnk *var[MAX_LINKS];
    Py_ssize_t n = 0;
    for (Py_ssize_t k = 0; k < nl; k++) {
        Lnk *l = &st->l[lk[k]];
        if (ln_len(l) == 1) {
            double r = ln_r(l, 0);
            if (r <= l->eps) return 0;
            cap = cap < r ? cap : r;
        } else {
            var[n++] = l;
        }
    }
    double t = ready, remaining = nbytes;
    if (n == 0) {
        double fin = t + remaining / cap;
        if (piece(st, t, fin, cap) < 0) return -1;
        *end = fin;
        return 1;
    }
    Py_ssize_t index[MAX_LINKS];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = ln_bisect_right(st, var[k], t, 0) - 1;
        index[k] = i < 0 ? 0 : i;
    }
    for (;;) {
        double rate = cap, nxt = INFINITY, blocked = -INFINITY;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *times = var[k]->times;
            Py_ssize_t i = index[k], last = PyList_GET_SIZE(times) - 1;
            while (i < last && FL(times, i + 1) <= t) i++;
            index[k] = i;
            double r = FL(var[k]->residual, i);
            double following = i < last ? FL(times, i + 1) : INFINITY;
            if (r <= var[k]->eps) {
                r = 0.0;
                if (following > blocked) blocked = following;
            }
            if (r < rate) rate = r;
            if (following < nxt) nxt = following;
        }
        if (rate <= 0.0) {
            if (blocked == INFINITY) return 0;
            t = blocked;
            continue;
        }
        double finish = t + remaining / rate;
        int done = finish <= nxt;
        double hi = done ? finish : nxt;
        if (piece(st, t, hi, rate) < 0) return -1;
        if (done) {
            *end = finish;
            return 1;
        }
        remaining -= rate * (nxt - t);
        t = nxt;
    }
}

/* changed_capacities(caps, succ) -> list of links: STFBook._recapacity's scan, the links of
   `caps` (link -> capacity its updates are classed by) whose capacity in the graph's
   adjacency `succ` (u -> v -> edge data) is no longer that one (compared as Python's !=
   compares them), in `caps`' order. KeyError where a link or its capacity is missing. */
PyObject *py_changed_capacities(PyObject *self, PyObject *args) {
    PyObject *caps, *succ;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &caps, &PyDict_Type, &succ)) return NULL;
    static PyObject *capacity; /* not s_capacity: stf_run makes its names together */
    if (capacity == NULL && (capacity = PyUnicode_InternFromString("capacity")) == NULL) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    PyObject *link, *cap;
    Py_ssize_t pos = 0;
    while (PyDict_Next(caps, &pos, &link, &cap)) {
        if (!PyTuple_CheckExact(link) || PyTuple_GET_SIZE(link) != 2) {
            PyErr_SetString(PyExc_TypeError, "changed_capacities: a link must be a pair of nodes");
            goto fail;
        }
        PyObject *u = PyTuple_GET_ITEM(link, 0), *v = PyTuple_GET_ITEM(link, 1);
        PyObject *nbrs = PyDict_GetItemWithError(succ, u), *data = NULL, *now = NULL;
        if (nbrs == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, u);
            goto fail;
        }
        if ((data = PyObject_GetItem(nbrs, v)) == NULL) goto fail; /* succ[u][v]["capacity"] */
        now = PyObject_GetItem(data, capacity);
        Py_DECREF(data);
        if (now == NULL) goto fail;
        int ne;
        if (PyFloat_CheckExact(now) && PyFloat_CheckExact(cap)) {
            ne = PyFloat_AS_DOUBLE(now) != PyFloat_AS_DOUBLE(cap);
        } else {
            PyObject *r = PyObject_RichCompare(now, cap, Py_NE);
            ne = r == NULL ? -1 : PyObject_IsTrue(r);
            Py_XDECREF(r);
        }
        Py_DECREF(now);
        if (ne < 0 || (ne && PyList_Append(out, link) < 0)) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}
