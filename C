/tmp/up117.txt:  two CPUs  C->C spin 100              round trip p50      0.8 us  p99      2.8 us  one-way p50     0.7 us  pipelined   2610817 items/s
/tmp/up117.txt:| two CPUs | C->C, spin 100 | 0.8 | 2.8 | 841.8x | 0.02x | 2,610,817 |
/tmp/up118.txt:  two CPUs  C->C spin 100              round trip p50      1.1 us  p99      4.0 us  one-way p50     0.9 us  pipelined   2422075 items/s
/tmp/up118.txt:| two CPUs | C->C, spin 100 | 1.1 | 4.0 | 692.8x | 0.02x | 2,422,075 |
/tmp/up118b.txt:  two CPUs  C->C spin 100              round trip p50      0.8 us  p99      2.8 us  one-way p50     0.7 us  pipelined   2645776 items/s
/tmp/up118b.txt:| two CPUs | C->C, spin 100 | 0.8 | 2.8 | 932.4x | 0.02x | 2,645,776 |
