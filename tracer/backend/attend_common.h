// The decode attention's parts every ISA path shares (attend_x86.h),
// included once per ISA namespace after its scores4<K, CC>, scores_group<K,
// CC> (kGroupKeys keys) and values_k<K, CC>: the scores of a block in the
// ISA's groups of keys, then quads (four keys masked for every bias row not
// read, the last keys padded to four), and the
// dispatch on the storage and the head size. Packed storage: `k` and `v`
// point to an AttendPacked.

template <int K, int CC>
void scores_k(const float* q, int R, int D, const void* k, int S, const float* bias, int per, float* out) {
  const int nb = (R + per - 1) / per;  // bias rows
  const auto masked4 = [&](int s) {
    for (int i = 0; i < nb; ++i) {
      const float* b = bias + size_t(i) * S + s;
      if (!(attend::masked_key(b[0]) && attend::masked_key(b[1]) && attend::masked_key(b[2]) &&
            attend::masked_key(b[3]))) {
        return false;
      }
    }
    return true;
  };
  int s = 0;
  for (; s + kGroupKeys <= S; s += kGroupKeys) {  // the ISA's groups of keys (quads masked for every row not read)
    unsigned live = 0;
    for (int g = 0; g < kGroupKeys / 4; ++g) live |= masked4(s + 4 * g) ? 0u : 1u << g;
    if (live == 0) {
      for (int r = 0; r < R; ++r)
        std::memcpy(out + size_t(r) * S + s, bias + size_t(r / per) * S + s, kGroupKeys * sizeof(float));
      continue;
    }
    attend::prefetch_rows<K>(k, s, kGroupKeys, D);
    scores_group<K, CC>(q, R, D, k, S, s, bias + s, per, live, out);
  }
  for (; s + 4 <= S; s += 4) {
    if (masked4(s)) {
      for (int r = 0; r < R; ++r) std::memcpy(out + size_t(r) * S + s, bias + size_t(r / per) * S + s, 4 * sizeof(float));
      continue;
    }
    attend::prefetch_rows<K>(k, s, 4, D);
    scores4<K, CC>(q, R, D, k, S, s, bias + s, per, out);
  }
  if (s < S) {  // the last keys: padded to four with masked ones (their rows not read)
    const int n = S - s;
    float t[64];
    thread_local std::vector<uint16_t> keys;
    thread_local std::vector<float> params;
    const void* four = nullptr;  // the last keys and three zero rows
    attend::AttendPacked tail{};
    if constexpr (attend::packed(K)) {
      const attend::AttendPacked& p = *static_cast<const attend::AttendPacked*>(k);
      keys.assign(4 * size_t(p.row_bytes) / 2, 0);
      params.assign(8 * size_t(p.groups), 0.0f);
      std::memcpy(keys.data(), p.data + size_t(s) * p.row_bytes, size_t(n) * p.row_bytes);
      std::memcpy(params.data(), p.scales + size_t(s) * p.groups, size_t(n) * p.groups * sizeof(float));
      std::memcpy(params.data() + 4 * p.groups, p.biases + size_t(s) * p.groups, size_t(n) * p.groups * sizeof(float));
      tail = {reinterpret_cast<const uint8_t*>(keys.data()), params.data(), params.data() + 4 * p.groups, p.row_bytes,
              p.groups, p.group_shift};
      four = &tail;
    } else {
      const size_t item = K == attend::f32 ? 4 : 2, row = size_t(D) * item;
      keys.assign(4 * row / 2, 0);
      std::memcpy(keys.data(), static_cast<const char*>(k) + s * row, n * row);
      four = keys.data();
    }
    for (int r = 0; r < R; ++r) {
      float b[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
      std::memcpy(b, bias + size_t(r / per) * S + s, n * sizeof(float));
      scores4<K, CC>(q + size_t(r) * D, 1, D, four, 4, 0, b, 1, t);
      std::memcpy(out + size_t(r) * S + s, t, n * sizeof(float));
    }
  }
}
template <int K>
void scores_d(const float* q, int R, int D, const void* k, int S, const float* bias, int per, float* out) {
  D == 64    ? scores_k<K, 4>(q, R, D, k, S, bias, per, out)
  : D == 128 ? scores_k<K, 8>(q, R, D, k, S, bias, per, out)
             : scores_k<K, 0>(q, R, D, k, S, bias, per, out);
}
template <int K>
void values_d(const float* p, int R, int S, const void* v, int D, float* out) {
  D == 64    ? values_k<K, 4>(p, R, S, v, D, out)
  : D == 128 ? values_k<K, 8>(p, R, S, v, D, out)
             : values_k<K, 0>(p, R, S, v, D, out);
}
void scores(const float* q, int R, int D, const void* k, int kind, int S, const float* bias, int per, float* out) {
  kind == attend::f32   ? scores_d<attend::f32>(q, R, D, k, S, bias, per, out)
  : kind == attend::f16 ? scores_d<attend::f16>(q, R, D, k, S, bias, per, out)
  : kind == attend::bf16 ? scores_d<attend::bf16>(q, R, D, k, S, bias, per, out)
  : kind == attend::q8  ? scores_d<attend::q8>(q, R, D, k, S, bias, per, out)
                        : scores_d<attend::q4>(q, R, D, k, S, bias, per, out);  // (q8i / q4i keys: split_scores)
}
void values(const float* p, int R, int S, const void* v, int kind, int D, float* out) {
  kind == attend::f32   ? values_d<attend::f32>(p, R, S, v, D, out)
  : kind == attend::f16 ? values_d<attend::f16>(p, R, S, v, D, out)
  : kind == attend::bf16 ? values_d<attend::bf16>(p, R, S, v, D, out)
  : kind == attend::q8  ? values_d<attend::q8>(p, R, S, v, D, out)
  : kind == attend::q4  ? values_d<attend::q4>(p, R, S, v, D, out)
  : kind == attend::q8i ? values_d<attend::q8i>(p, R, S, v, D, out)
                        : values_d<attend::q4i>(p, R, S, v, D, out);
}
