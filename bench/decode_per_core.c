/* One core's decode throughput (thread CPU time, best of N single calls, each
 * reading K/V from memory) against a one-thread streaming read timed in the
 * same rounds: the by-hand supplement of bench/RESULTS.md for a machine too
 * loaded for `make bench`. B=1, Hq=16, Hkv=8, Q f32, K/V [Hkv, kv, D].
 *
 *   clang -O3 -ffp-contract=off -ISources/FlashMetalCPUKernels/include \
 *     -ISources/FlashMetalCPUKernels -ISources/CFlashMetal/include bench/decode_per_core.c \
 *     every Sources/FlashMetalCPUKernels/X.c but pool.c and sdpa.c -lm -o decode_per_core
 *   [FLASHMETAL_CPU_ISA=avx2] ./decode_per_core D dtype(0 f32, 1 f16, 2 bf16) kv_len rounds */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "fm_cpu_kernels.h"
static double cpu_now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static volatile unsigned long long sink;
static double readbw(const unsigned long long *a, size_t n){ double t0=cpu_now();
  typedef unsigned long long u8v __attribute__((ext_vector_type(8)));
  u8v acc[4]={0};
  for(size_t i=0;i+32<=n;i+=32){ u8v x[4]; memcpy(x,a+i,256); for(int j=0;j<4;j++) acc[j]|=x[j];}
  u8v t=acc[0]|acc[1]|acc[2]|acc[3]; unsigned long long s=0; for(int j=0;j<8;j++) s|=t[j]; sink=s; return n*8/(cpu_now()-t0)/1e9; }
int main(int argc,char**argv){
  int D=atoi(argv[1]), dt=atoi(argv[2]); int kvl=atoi(argv[3]); int H=16,Hkv=8,nwg=32, reps=atoi(argv[4]);
  size_t esz=dt==0?4:2, n=(size_t)Hkv*kvl*D;
  unsigned short *k=malloc(n*esz),*v=malloc(n*esz);
  for(size_t i=0;i<n*esz/2;i++){ k[i]=0x3c00^(i*2654435761u>>20&0x3ff); v[i]=0x3c00^(i*40503u>>6&0x3ff);} /* finite f16/bf16/f32 bit patterns */
  float *q=calloc(H*D,4), *tmp=calloc((size_t)H*nwg*(D+2),4);
  for(int i=0;i<H*D;i++) q[i]=0.01f*(i%7);
  FlashAttnVecParams p={.n_heads=H,.n_kv_heads=Hkv,.head_dim=D,.kv_seq_len=kvl,.kv_capacity=kvl,.scale=0.1f,
                        .mask_type=1,.nwg=nwg,.head_dim_v=D};
  FMVecArgs a; memset(&a,0,sizeof a); a.p=p; a.q=q;a.k=k;a.v=v;a.tmp=tmp;a.batch=1;a.kv_dtype=dt;
  a.k_strides[1]=(int64_t)kvl*D;a.k_strides[2]=D; memcpy(a.v_strides,a.k_strides,24);
  float *scr=malloc(4*fm_cpu_vec_scratch_floats(&a));
  size_t bn=(size_t)64<<20; unsigned long long *big=malloc(bn*8); memset(big,1,bn*8);
  double bt=1e9,bb=0;
  for(int rep=0;rep<reps;rep++){
    double bw=readbw(big,bn); if(bw>bb)bb=bw;
    double t0=cpu_now();
    for(int r=0;r<Hkv;r++) for(int w=0;w<nwg;w++) fm_cpu_vec_item(&a,r,w,scr);
    double t=cpu_now()-t0; if(t<bt)bt=t;
  }
  printf("%s kv=%d D=%d %s: %.2f ms/call/core %.1f GB/s, stream read %.1f GB/s: %.0f%%\n", getenv("FLASHMETAL_CPU_ISA")?getenv("FLASHMETAL_CPU_ISA"):"native",
         kvl, D, dt==0?"f32":dt==1?"f16":"bf16", bt*1e3, 2*n*esz/bt/1e9, bb, 100*2*n*esz/bt/1e9/bb);
}
