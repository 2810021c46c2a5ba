// The fused CPU kernel of paged_packed.py (packed paged prefix + float paged tail, one pass): plain C++17, no
// torch headers. _packed_cpu.py compiles it on first use (cache keyed by this file's text, the flags and the
// compiler) and calls vc_packed_attention through ctypes; its docstring describes the algorithm.
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <thread>
#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

inline float h2f(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, b;
  if (e == 0) {
    if (m == 0) { b = s; } else {  // subnormal: normalise
      int k = -1; do { k++; m <<= 1; } while (!(m & 0x400));
      b = s | ((uint32_t)(127 - 15 - k) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (e == 31) { b = s | 0x7f800000u | (m << 13); }
  else { b = s | ((e + 112) << 23) | (m << 13); }
  float f; std::memcpy(&f, &b, 4); return f;
#endif
}

inline void h2f_n(const uint16_t* src, float* dst, int n) {
  int i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; i++) dst[i] = h2f(src[i]);
}

inline void bf2f_n(const uint16_t* src, float* dst, int n) {
  for (int i = 0; i < n; i++) { uint32_t b = (uint32_t)src[i] << 16; std::memcpy(dst + i, &b, 4); }
}

inline float fp8e4m3(uint8_t c) {  // e4m3fn bits placed in a float32, times 2^120 (subnormals included)
  uint32_t b = ((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7f) << 20);
  float f; std::memcpy(&f, &b, 4); return f * 1.329227995784916e36f;
}

inline float fast_exp(float x) {  // exp(x) for x <= 0 (and -inf -> 0)
  x = x < -87.0f ? -87.0f : x;
  float n = std::floor(x * 1.4426950408889634f + 0.5f);
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float s; std::memcpy(&s, &e, 4);
  return p * s;
}

struct Args {
  const float* q; float* out; const int32_t* qsl; int B, Hq, Hkv, D;
  int fmt, kbits, vbits, kgroup, vgroup, bs;
  const uint8_t* kc; const uint16_t* ks; const uint16_t* kz; const uint8_t* vc; const uint16_t* vs; const uint16_t* vz;
  const int32_t* plen; const int32_t* ptab; int pw;
  const void* tk; const void* tv; int tdt; const int32_t* tlen; const int32_t* ttab; int tw; int tbs;
  float scale;
};

constexpr float NEG = -1e30f;

struct State {  // M query vectors of one (row, head)
  int M, D; std::vector<float> q, mx, l, acc, s, p;
  State(int M_, int D_, int bs) : M(M_), D(D_), q(M_ * D_), mx(M_, NEG), l(M_, 0.f), acc(M_ * D_, 0.f),
                                   s(M_ * bs), p(M_ * bs) {}
};

#if defined(__AVX2__) && defined(__FMA__)
#define VC_AVX2 1
inline __m256 exp8(__m256 x) {  // fast_exp on 8 lanes
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f)); p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// 8 codes of `bits` bits at shift `sh` of 8 consecutive bytes -> 8 floats
inline __m256 codes8(const uint8_t* c, int sh, int mask) {
  __m128i b = _mm_loadl_epi64((const __m128i*)c);
  b = _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(sh)), _mm_set1_epi8((char)mask));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}
#endif

// o[j] = code(c[j] >> sh) * s + z for j < run (a run of whole bytes)
inline void dequant_run(const uint8_t* c, int sh, int mask, float s, float z, float* o, int run) {
  int j = 0;
#ifdef VC_AVX2
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  for (; j + 8 <= run; j += 8) _mm256_storeu_ps(o + j, _mm256_fmadd_ps(codes8(c + j, sh, mask), vs, vz));
  for (; j + 4 <= run; j += 4) {
    int32_t w; std::memcpy(&w, c + j, 4);
    __m128i b = _mm_and_si128(_mm_srl_epi16(_mm_cvtsi32_si128(w), _mm_cvtsi32_si128(sh)), _mm_set1_epi8((char)mask));
    _mm_storeu_ps(o + j, _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_cvtepu8_epi32(b)), _mm_set1_ps(s), _mm_set1_ps(z)));
  }
#endif
  for (; j < run; j++) o[j] = (float)((c[j] >> sh) & mask) * s + z;
}

// scores s[m][k] = q_m . kT[:, k] for k < n (n a multiple of 16; up to 4 queries x 16 tokens in registers)
inline void scores(State& st, const float* kT, int ld, int n) {
  const int D = st.D;
#ifdef VC_AVX2
  for (int m0 = 0; m0 < st.M; m0 += 4) {
    const int mm = st.M - m0 < 4 ? st.M - m0 : 4;
    for (int k0 = 0; k0 < n; k0 += 16) {
      __m256 a[4][2];
      for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
      for (int d = 0; d < D; d++) {
        const __m256 r0 = _mm256_loadu_ps(kT + d * ld + k0), r1 = _mm256_loadu_ps(kT + d * ld + k0 + 8);
        for (int i = 0; i < mm; i++) {
          const __m256 qd = _mm256_broadcast_ss(&st.q[(m0 + i) * D + d]);
          a[i][0] = _mm256_fmadd_ps(qd, r0, a[i][0]); a[i][1] = _mm256_fmadd_ps(qd, r1, a[i][1]);
        }
      }
      for (int i = 0; i < mm; i++) {
        _mm256_storeu_ps(&st.s[(m0 + i) * ld + k0], a[i][0]); _mm256_storeu_ps(&st.s[(m0 + i) * ld + k0 + 8], a[i][1]);
      }
    }
  }
#else
  for (int m = 0; m < st.M; m++)
    for (int k = 0; k < n; k++) {
      float a = 0; for (int d = 0; d < D; d++) a += st.q[m * D + d] * kT[d * ld + k];
      st.s[m * ld + k] = a;
    }
#endif
}

// online softmax over n scored tokens (vis(m, k) == false -> masked), then acc += p V (vb [n][D])
template <typename Vis>
inline void update(State& st, const float* vb, int ld, int n, Vis vis) {
  const int D = st.D;
  for (int m = 0; m < st.M; m++) {
    float* sm = &st.s[m * ld]; float* pm = &st.p[m * ld];
    float bm = NEG;
    for (int k = 0; k < n; k++) { if (!vis(m, k)) sm[k] = NEG; bm = sm[k] > bm ? sm[k] : bm; }
    if (bm <= NEG) { for (int k = 0; k < n; k++) pm[k] = 0.f; continue; }
    const float mnew = st.mx[m] > bm ? st.mx[m] : bm;
    const float alpha = fast_exp(st.mx[m] - mnew);
    float sum = 0.f;
    int k = 0;
#ifdef VC_AVX2
    __m256 vsum = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(mnew), neg = _mm256_set1_ps(NEG * 0.5f);
    for (; k + 8 <= n; k += 8) {
      const __m256 x = _mm256_loadu_ps(sm + k);
      __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, vm)), _mm256_cmp_ps(x, neg, _CMP_GT_OQ));
      _mm256_storeu_ps(pm + k, e); vsum = _mm256_add_ps(vsum, e);
    }
    float tmp[8]; _mm256_storeu_ps(tmp, vsum); for (int i = 0; i < 8; i++) sum += tmp[i];
#endif
    for (; k < n; k++) { float e = sm[k] <= NEG ? 0.f : fast_exp(sm[k] - mnew); pm[k] = e; sum += e; }
    st.l[m] = st.l[m] * alpha + sum;
    st.mx[m] = mnew;
    float* am = &st.acc[m * D];
#ifdef VC_AVX2
    const __m256 va = _mm256_set1_ps(alpha);
    for (int d0 = 0; d0 < D; d0 += 32) {  // 32 channels (4 registers) at a time over the n tokens
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(am + d0), va), a1 = _mm256_mul_ps(_mm256_loadu_ps(am + d0 + 8), va);
      __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(am + d0 + 16), va), a3 = _mm256_mul_ps(_mm256_loadu_ps(am + d0 + 24), va);
      for (int t = 0; t < n; t++) {
        if (pm[t] == 0.f) continue;
        const __m256 pk = _mm256_broadcast_ss(pm + t); const float* row = vb + t * D + d0;
        a0 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(row), a0); a1 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(row + 8), a1);
        a2 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(row + 16), a2); a3 = _mm256_fmadd_ps(pk, _mm256_loadu_ps(row + 24), a3);
      }
      _mm256_storeu_ps(am + d0, a0); _mm256_storeu_ps(am + d0 + 8, a1);
      _mm256_storeu_ps(am + d0 + 16, a2); _mm256_storeu_ps(am + d0 + 24, a3);
    }
#else
    for (int d = 0; d < D; d++) am[d] *= alpha;
    for (int t = 0; t < n; t++) {
      const float pk = pm[t]; if (pk == 0.f) continue;
      for (int d = 0; d < D; d++) am[d] += pk * vb[t * D + d];
    }
#endif
  }
}

void work(const Args& a, int b, int h, std::vector<float>& kT, std::vector<float>& vb) {
  const int D = a.D, G = a.Hq / a.Hkv, bs = a.bs;
  const int q0 = a.qsl[b], lq = a.qsl[b + 1] - q0, M = G * lq;
  if (lq <= 0) return;
  State st(M, D, std::max(bs, a.tbs));
  for (int g = 0; g < G; g++)
    for (int i = 0; i < lq; i++)
      for (int d = 0; d < D; d++) st.q[(g * lq + i) * D + d] = a.q[((size_t)(q0 + i) * a.Hq + h * G + g) * D + d] * a.scale;
  // ---- packed prefix (fully visible) ----
  const int n = a.plen[b];
  const int kper = 8 / a.kbits, vper = 8 / a.vbits;
  const int knb = bs / kper, vnb = D / vper;  // bytes per key channel row (KIVI), per value row (KIVI)
  std::vector<int> tok(bs);  // token of position k in a decoded block
  for (int k = 0; k < bs; k++) tok[k] = a.fmt == 0 ? (k % knb) * kper + k / knb : k;
  std::vector<float> ksc(bs, 1.f), sc(bs);
  for (int blk = 0; blk * bs < n; blk++) {
    const int64_t bid = a.ptab[(size_t)b * a.pw + blk];
    const int valid = std::min(bs, n - blk * bs);
    const int64_t bh = bid * a.Hkv + h;
    if (a.fmt == 0) {  // KIVI: keys packed along tokens [D][bs*kbits/8], scale/min [D][bs/kgroup]
      const int ng = bs / a.kgroup, run = a.kgroup / kper, kmask = (1 << a.kbits) - 1;
      for (int d = 0; d < D; d++) {
        const uint8_t* c = a.kc + (bh * D + d) * knb;
        const uint16_t* s16 = a.ks + (bh * D + d) * ng; const uint16_t* z16 = a.kz + (bh * D + d) * ng;
        float* row = &kT[d * bs];
        for (int gi = 0; gi < ng; gi++) {
          const float s = h2f(s16[gi]), z = h2f(z16[gi]);
          for (int sh = 0; sh < kper; sh++) {
            dequant_run(c + gi * run, sh * a.kbits, kmask, s, z, row + sh * knb + gi * run, run);
          }
        }
      }
      const int ngv = D / a.vgroup, vrun = a.vgroup / vper, vmask = (1 << a.vbits) - 1;
      for (int k = 0; k < bs; k++) {
        const int t = tok[k];
        float* o = &vb[k * D];
        if (t >= valid) { std::memset(o, 0, D * sizeof(float)); continue; }
        const uint8_t* c = a.vc + (bh * bs + t) * vnb;
        const uint16_t* s16 = a.vs + (bh * bs + t) * ngv; const uint16_t* z16 = a.vz + (bh * bs + t) * ngv;
        for (int gi = 0; gi < ngv; gi++) {
          const float s = h2f(s16[gi]), z = h2f(z16[gi]);
          for (int sh = 0; sh < vper; sh++) {
            dequant_run(c + gi * vrun, sh * a.vbits, vmask, s, z, o + sh * vnb + gi * vrun, vrun);
          }
        }
      }
      scores(st, kT.data(), bs, bs);
    } else {  // int8 / fp8: keys [D][bs], values [bs][D], one float16 scale per token
      const uint8_t* kcb = a.kc + bh * (int64_t)D * bs;
      for (int d = 0; d < D; d++) {
        float* row = &kT[d * bs]; const uint8_t* c = kcb + d * bs;
        if (a.fmt == 1) { for (int t = 0; t < bs; t++) row[t] = (float)(int8_t)c[t]; }
        else { for (int t = 0; t < bs; t++) row[t] = fp8e4m3(c[t]); }
      }
      h2f_n(a.ks + bh * bs, ksc.data(), bs);
      h2f_n(a.vs + bh * bs, sc.data(), bs);
      for (int t = 0; t < bs; t++) {
        float* o = &vb[t * D]; const uint8_t* c = a.vc + (bh * bs + t) * D;
        const float s = t < valid ? sc[t] : 0.f;
        if (a.fmt == 1) { for (int d = 0; d < D; d++) o[d] = (float)(int8_t)c[d] * s; }
        else { for (int d = 0; d < D; d++) o[d] = fp8e4m3(c[d]) * s; }
      }
      scores(st, kT.data(), bs, bs);
      for (int m = 0; m < M; m++) for (int t = 0; t < bs; t++) st.s[m * bs + t] *= ksc[t];
    }
    update(st, vb.data(), bs, bs, [&](int, int k) { return tok[k] < valid; });
  }
  if (a.fmt == 0 && n > 0) {  // KIVI values were decoded channel-permuted: put the accumulator back in order
    std::vector<float> tmp(D);
    const int vrun = a.vgroup / vper;
    for (int m = 0; m < M; m++) {
      float* am = &st.acc[m * D];
      for (int gi = 0; gi < D / a.vgroup; gi++)
        for (int sh = 0; sh < vper; sh++)
          for (int j = 0; j < vrun; j++) tmp[(gi * vrun + j) * vper + sh] = am[sh * vnb + gi * vrun + j];
      std::memcpy(am, tmp.data(), D * sizeof(float));
    }
  }
  // ---- float tail (vLLM CPU layout: keys [D][tbs], values [tbs][D]); causal bottom-right ----
  const int nt = a.tlen[b], tbs = a.tbs;
  const size_t esz = a.tdt == 2 ? 4 : 2;
  for (int blk = 0; blk * tbs < nt; blk++) {
    const int64_t bh = (int64_t)a.ttab[(size_t)b * a.tw + blk] * a.Hkv + h;
    const int valid = std::min(tbs, nt - blk * tbs);
    const char* kb = (const char*)a.tk + (size_t)bh * D * tbs * esz;
    const char* vbp = (const char*)a.tv + (size_t)bh * tbs * D * esz;
    if (a.tdt == 0) { h2f_n((const uint16_t*)kb, kT.data(), D * tbs); h2f_n((const uint16_t*)vbp, vb.data(), tbs * D); }
    else if (a.tdt == 1) { bf2f_n((const uint16_t*)kb, kT.data(), D * tbs); bf2f_n((const uint16_t*)vbp, vb.data(), tbs * D); }
    else { std::memcpy(kT.data(), kb, D * tbs * 4); std::memcpy(vb.data(), vbp, tbs * D * 4); }
    for (int t = valid; t < tbs; t++) std::memset(&vb[t * D], 0, D * sizeof(float));
    scores(st, kT.data(), tbs, tbs);
    const int base = blk * tbs;
    update(st, vb.data(), tbs, tbs, [&](int m, int k) { return k < valid && base + k <= nt - lq + m % lq; });
  }
  for (int g = 0; g < G; g++)
    for (int i = 0; i < lq; i++) {
      const int m = g * lq + i;
      const float inv = st.l[m] > 0 ? 1.f / st.l[m] : 0.f;
      float* o = a.out + ((size_t)(q0 + i) * a.Hq + h * G + g) * D;
      for (int d = 0; d < D; d++) o[d] = st.acc[m * D + d] * inv;
    }
}

}  // namespace

extern "C" int vc_packed_attention(
    const float* q, float* out, const int32_t* qsl, int B, int Hq, int Hkv, int D,
    int fmt, int kbits, int vbits, int kgroup, int vgroup, int bs,
    const uint8_t* kc, const uint16_t* ks, const uint16_t* kz, const uint8_t* vc, const uint16_t* vs, const uint16_t* vz,
    const int32_t* plen, const int32_t* ptab, int pw,
    const void* tk, const void* tv, int tdt, const int32_t* tlen, const int32_t* ttab, int tw, int tbs,
    float scale, int nthreads) {
  Args a{q, out, qsl, B, Hq, Hkv, D, fmt, kbits, vbits, kgroup, vgroup, bs, kc, ks, kz, vc, vs, vz,
         plen, ptab, pw, tk, tv, tdt, tlen, ttab, tw, tbs, scale};
  const int items = B * Hkv;
  const int nt = std::max(1, std::min(nthreads, items));
  auto run = [&](int tid) {
    std::vector<float> kT(D * std::max(bs, tbs)), vb(std::max(bs, tbs) * D);
    for (int it = tid; it < items; it += nt) work(a, it / Hkv, it % Hkv, kT, vb);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < nt; t++) pool.emplace_back(run, t);
  run(0);
  for (auto& t : pool) t.join();
  return 0;
}
