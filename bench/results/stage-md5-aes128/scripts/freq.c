#include <stdio.h>
#include <time.h>
int main(){ struct timespec a,b; long n=2000000000; long x=0;
clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&a);
for(long i=0;i<n;i++){ __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x)); }
clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&b);
double s=(b.tv_sec-a.tv_sec)+(b.tv_nsec-a.tv_nsec)/1e9; printf("%.2f GHz (4 dependent adds per iteration)\n", 4.0*n/s/1e9); }
