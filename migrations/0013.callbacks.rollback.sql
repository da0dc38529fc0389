-- Back to 0012: the record of callback deliveries goes (a replay of one of them would then poll once more).
DROP TABLE callback_deliveries;
