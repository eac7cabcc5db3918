%% The harness's `mesh' scenario: clusters of more than two nodes, every node
%% sending to a receiver on every other node at once, where a lane's batches hold
%% only one node's share of a sender's traffic.
-module(convoy_bench_mesh).

-export([measure/2]).
%% Spawned on the nodes taking part.
-export([mesh_sender/4]).

-import(convoy_bench_measure, [await/2, timeout/1, secs/1, send_all/4, finish/3]).

%% @doc One `mesh' point: N nodes (this one and N - 1 sinks), on every node one
%% sender to a receiver on each other node, all started at once: event-shaped
%% messages, `per_pair' each.
-spec measure(map(), convoy_bench_measure:ctx()) -> convoy_bench_measure:figures().
measure(#{nodes := N, per_pair := M}, Ctx = #{mode := Mode, sinks := Sinks})
  when length(Sinks) >= N - 1 ->
    Nodes = [node() | lists:sublist(Sinks, N - 1)],
    Self = self(),
    Consumers = [{From, spawn_opt(To, convoy_bench_measure, consumer, [Mode, 0],
                                   [{message_queue_data, off_heap}])}
                 || From <- Nodes, To <- Nodes, From =/= To],
    Senders = [spawn(From, ?MODULE, mesh_sender, [Mode, C, M, Self]) || {From, C} <- Consumers],
    [await({mesh_ready, S}, Ctx) || S <- Senders],
    T0 = erlang:monotonic_time(),
    [S ! go || S <- Senders],
    Counts = [receive {done, C, Cnt} -> Cnt
              after timeout(Ctx) -> exit({timeout, mesh_consumer})
              end || {_, C} <- Consumers],
    T1 = erlang:monotonic_time(),
    Sent = M * length(Consumers),
    lists:sum(Counts) =:= Sent orelse exit({lost, Sent - lists:sum(Counts)}),
    Rate = Sent / secs(T1 - T0),
    #{msg_s => Rate, node_msg_s => Rate / N}.

%% @doc A mesh sender: ready, then `N' event-shaped messages to `C' and its
%% `done' behind them (the consumer answers the driver).
-spec mesh_sender(convoy_bench_measure:mode(), pid(), pos_integer(), pid()) -> ok.
mesh_sender(M, C, N, Driver) ->
    Driver ! {mesh_ready, self()},
    receive go -> ok end,
    send_all(M, C, event, N),
    finish(M, C, {done, Driver}).
