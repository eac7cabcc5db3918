%% A PropEr model of the send path's accounting, against convoy running here and
%% on two peers: random sequences of sends (small and large, `send/2', `send/3',
%% `send_many/1', `multicast/2') from one process to three receivers, mixed with
%% changes of settings (`lanes', `bypass_after', `max_delay', the bound and the
%% overload policy), with the sender's lane suspended and resumed so that the
%% bound is reached, and with other senders killed while they wait (for room at
%% the bound, for a barrier, for a message in pieces). After each sequence, once
%% the lanes have shipped everything:
%% <ul>
%% <li>every admission to every lane was disposed of, once (admitted = disposed);</li>
%% <li>per node, what was accepted was handed to distribution or dropped
%%   (accepted = messages + dropped), nothing is buffered or queued;</li>
%% <li>each receiver got its messages in order and once each, and each node got
%%   exactly what it was counted as handed to distribution (a multicast counts
%%   one per node, its copy fanned out there): every message `send/3' refused
%%   (`{error, overload}') and every one counted as dropped is missing, and no
%%   other.</li>
%% </ul>
-module(convoy_accounting_SUITE).

-include_lib("common_test/include/ct.hrl").
-include_lib("stdlib/include/assert.hrl").
-include_lib("proper/include/proper.hrl").
-include("../src/convoy_runtime.hrl").

-export([all/0, suite/0, init_per_suite/1, end_per_suite/1]).
-export([admitted_disposed_once/1]).
%% Run on peer nodes.
-export([collector/0]).

%% A short block_timeout: a sender blocked at a suspended lane waits it out.
-define(BASE, #{lanes => 1, bypass_after => 20, max_delay => 0, max_buffered => 1000000,
                overload => block, block_timeout => 200, large_threshold => 1000}).

suite() ->
    [{timetrap, {minutes, 8}}].

all() ->
    [admitted_disposed_once].

init_per_suite(Config) ->
    _ = application:stop(convoy),
    Config.

end_per_suite(_Config) ->
    convoy_ct_peers:stop_local().

%% (peers live as long as the process that starts them: the test case's)
admitted_disposed_once(_Config) ->
    convoy_ct_peers:start_local(?BASE),
    {_PB, B} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(acc_b), #{lanes => 2}),
    {_PC, C} = convoy_ct_peers:convoy_peer(?MODULE, ?CT_PEER_NAME(acc_c), #{}),
    Prop = ?FORALL({Bound, Ops}, {oneof([5, 50, 1000000]), ops()},
                   begin
                       Result = try run(Bound, Ops, B, C)
                                catch Cl:R:St -> {crashed, Cl, R, St}
                                end,
                       ?WHENFAIL(ct:pal("~p ~p~n=> ~p", [Bound, Ops, Result]), Result =:= ok)
                   end),
    ?assertEqual(ok, convoy_prop:check(Prop, [{numtests, 60}, {to_file, user},
                                              {max_shrinks, 50}])).

%%--------------------------------------------------------------------
%% Generators

ops() ->
    list(op()).

op() ->
    frequency([{10, {send, dest(), size()}},
               {3, {send_error, dest(), size()}},
               {4, {send_many, list({dest(), size()})}},
               {3, {multicast, non_empty(list(dest())), size()}},
               {2, {burst, dest(), range(1, 300)}},
               {3, {killed, dest(), range(1, 60), size()}},
               {3, suspend},
               {2, resume},
               {1, {set, lanes, range(1, 3)}},
               {1, {set, bypass_after, oneof([0, 20, never])}},
               {1, {set, max_delay, oneof([0, 1])}},
               {1, {set, max_buffered, oneof([5, 50, 1000000])}},
               {1, {set, overload, oneof([block, drop, error])}}]).

%% Receivers: two on B, one on C. Each sequence starts with a bound of its own
%% (max_buffered), so that suspended lanes reach it.
dest() -> range(1, 3).

size() -> frequency([{6, small}, {1, large}]).

%%--------------------------------------------------------------------
%% One sequence

run(Bound, Ops, B, C) ->
    ok = settle(?BASE#{max_buffered => Bound}),
    Receivers = [spawn(B, ?MODULE, collector, []), spawn(B, ?MODULE, collector, []),
                 spawn(C, ?MODULE, collector, [])],
    Before = counters([B, C]),
    Self = self(),
    Sender = spawn_link(fun() -> Self ! {done, self(), sender(Ops, Receivers, #{})} end),
    {Sent, Refused} = receive {done, Sender, R} -> R after 120000 -> exit(sender_stuck) end,
    ok = convoy:flush(),
    After = counters([B, C]),
    check(Before, After, Receivers, [B, B, C], Sent, Refused).

%% The sender: every message numbered per receiver; returns how many each
%% receiver was sent and how many of those send/3 refused.
sender([], _Receivers, Next) ->
    ok = resume_lanes(),
    %% flush/0 waits for the caller's own messages: the sender's, whichever lanes
    %% it used (the test process's lane may be another one)
    ok = convoy:flush(),
    {Next, maps:get(refused, get_refused(), #{})};
sender([Op | Ops], Receivers, Next) ->
    sender(Ops, Receivers, op(Op, Receivers, Next)).

get_refused() ->
    case get(refused) of
        undefined -> #{};
        R -> #{refused => R}
    end.

op({send, D, Size}, Rs, Next) ->
    {To, Msg, Next1} = message(D, Size, Rs, Next),
    ok = convoy:send(To, Msg),
    Next1;
op({send_error, D, Size}, Rs, Next) ->
    {To, Msg, Next1} = message(D, Size, Rs, Next),
    case convoy:send(To, Msg, #{overload => error}) of
        ok -> ok;
        {error, overload} -> refused(D)
    end,
    Next1;
op({send_many, List}, Rs, Next) ->
    {Msgs, Next1} = lists:mapfoldl(fun({D, Size}, N) ->
                                           {To, Msg, N1} = message(D, Size, Rs, N),
                                           {{To, Msg}, N1}
                                   end, Next, List),
    ok = convoy:send_many(Msgs),
    Next1;
op({multicast, Ds0, Size}, Rs, Next) ->
    %% one copy per receiver, numbered for each
    Ds = lists:usort(Ds0),
    Tag = erlang:unique_integer([positive]),
    Next1 = lists:foldl(fun(D, N) -> N#{D => maps:get(D, N, 0) + 1} end, Next, Ds),
    Numbers = maps:from_list([{lists:nth(D, Rs), maps:get(D, Next1)} || D <- Ds]),
    ok = convoy:multicast([lists:nth(D, Rs) || D <- Ds], {multi, self(), Tag, Numbers, payload(Size)}),
    Next1;
op({killed, D, K, Size}, Rs, Next) ->
    %% another sender, killed as soon as it waits (or once it is done): its
    %% messages are counted by the receiver apart from the numbered ones
    R = lists:nth(D, Rs),
    Pid = spawn(fun() ->
                        [convoy:send(R, {extra, self(), I, payload(Size)})
                         || I <- lists:seq(1, K)],
                        receive stop -> ok end
                end),
    ok = kill_when_waiting(Pid, erlang:monitor(process, Pid)),
    Next;
op({burst, D, K}, Rs, Next) ->
    lists:foldl(fun(_, N) -> op({send, D, small}, Rs, N) end, Next, lists:seq(1, K));
op(suspend, _Rs, Next) ->
    Suspended = [L || L <- lanes(), not lists:member(L, suspended()),
                      erlang:suspend_process(L)],
    put(suspended, Suspended ++ suspended()),
    Next;
op(resume, _Rs, Next) ->
    ok = resume_lanes(),
    Next;
op({set, Key, Value}, _Rs, Next) ->
    ok = set(#{Key => Value}),
    Next.

kill_when_waiting(Pid, Mon) ->
    case erlang:process_info(Pid, status) of
        {status, waiting} ->
            exit(Pid, kill),
            receive {'DOWN', Mon, process, Pid, _} -> ok end;
        undefined ->
            receive {'DOWN', Mon, process, Pid, _} -> ok end;
        _Running ->
            erlang:yield(),
            kill_when_waiting(Pid, Mon)
    end.

message(D, Size, Rs, Next) ->
    I = maps:get(D, Next, 0) + 1,
    {lists:nth(D, Rs), {seq, self(), I, payload(Size)}, Next#{D => I}}.

payload(small) -> small;
payload(large) -> binary:copy(<<"L">>, 2000).

refused(D) ->
    R = case get(refused) of undefined -> #{}; M -> M end,
    put(refused, R#{D => maps:get(D, R, 0) + 1}).

%% Settings as given, waiting out a lanes change in progress; a lanes change
%% with a lane suspended would wait for it: the sender resumes its lanes first.
set(#{lanes := _} = Change) ->
    ok = resume_lanes(),
    set_now(Change);
set(Change) ->
    set_now(Change).

set_now(Change) ->
    case convoy:set_config(Change) of
        ok -> ok;
        {error, {busy, lanes}} -> timer:sleep(5), set_now(Change)
    end.

%% Between sequences, in the test process (the sender that suspended lanes has
%% resumed them before it ended).
settle(Settings) ->
    ok = set_now(Settings),
    ok = convoy:flush().

%% The lanes this process suspended (only the suspender may resume a process).
suspended() ->
    case get(suspended) of
        undefined -> [];
        L -> L
    end.

resume_lanes() ->
    [true = erlang:resume_process(L) || L <- suspended(), is_process_alive(L)],
    erase(suspended),
    ok.

lanes() ->
    [L || {_Node, #runtime{lanes = Lanes}} <- convoy_runtimes:rows(), L <- tuple_to_list(Lanes)].

%%--------------------------------------------------------------------
%% The invariants

counters(Nodes) ->
    Info = maps:get(nodes, convoy:info()),
    maps:from_list([{N, maps:get(N, Info, #{accepted => 0, messages => 0, dropped => 0,
                                            buffered => 0, queued => 0})}
                    || N <- Nodes]).

check(Before, After0, Receivers, ReceiverNodes, Sent, Refused) ->
    %% a killed sender's messages may still be in another lane than the sender's
    {Lanes, After} = settled(ReceiverNodes, 250),
    Delta = fun(N, K) -> maps:get(K, maps:get(N, After)) - maps:get(K, maps:get(N, Before)) end,
    Nodes = lists:usort(ReceiverNodes),
    Got = [report(R) || R <- Receivers],
    Expected = [{N, Delta(N, messages)} || N <- Nodes],
    %% per node: messages sent to one receiver, plus one per multicast copy
    Delivered = [{N, lists:sum([Single + Extra
                                || {{_, _, _, Single, _, Extra}, RN} <- lists:zip(Got, ReceiverNodes),
                                   RN =:= N])
                     + sets:size(sets:union([Tags || {{_, _, _, _, Tags, _}, RN}
                                                         <- lists:zip(Got, ReceiverNodes),
                                                     RN =:= N]))}
                 || N <- Nodes],
    Problems =
        [{lane_not_settled, A, D} || {A, D} <- Lanes, A =/= D]
        ++ [{accounting, N, Delta(N, accepted), Delta(N, messages), Delta(N, dropped)}
            || N <- Nodes, Delta(N, accepted) =/= Delta(N, messages) + Delta(N, dropped)]
        ++ [{still_held, N} || N <- Nodes, maps:get(buffered, maps:get(N, After)) =/= 0
                                   orelse maps:get(queued, maps:get(N, After)) =/= 0]
        ++ [{out_of_order, I} || {I, {_, Bad, _, _, _, _}} <- lists:zip([1, 2, 3], Got), Bad =/= 0]
        ++ [{delivered, Delivered, counted, Expected} || Delivered =/= Expected]
        ++ [{more_than_sent, I} || {I, {Count, _, _, _, _, _}} <- lists:zip([1, 2, 3], Got),
                                   Count > maps:get(I, Sent, 0) - maps:get(I, Refused, 0)],
    case Problems of
        [] -> ok;
        _ -> {Problems, Lanes, After0}
    end.

%% Every lane's admissions and disposals, and the nodes' counters, once every
%% admission was disposed of and nothing is held (or after Tries polls).
settled(Nodes, Tries) ->
    Lanes = [{convoy_slots:admitted(S), convoy_slots:disposed(S)}
             || {_Node, #runtime{slots = Slots}} <- convoy_runtimes:rows(),
                S <- tuple_to_list(Slots)],
    Counters = counters(lists:usort(Nodes)),
    Held = [N || {N, #{buffered := B, queued := Q}} <- maps:to_list(Counters), B + Q =/= 0],
    case [A || {A, D} <- Lanes, A =/= D] =:= [] andalso Held =:= [] of
        true -> {Lanes, Counters};
        false when Tries =< 0 -> {Lanes, Counters};
        false -> timer:sleep(20), settled(Nodes, Tries - 1)
    end.

%% {Count, OutOfOrder, Last, Single, MulticastTags, Extra}, once the receiver has had
%% nothing new for a while.
report(R) ->
    report(R, undefined, 0).

report(R, Last, Quiet) ->
    R ! {report, self()},
    receive
        {report, R, Now} when Now =:= Last, Quiet >= 3 -> Now;
        {report, R, Now} when Now =:= Last -> timer:sleep(20), report(R, Now, Quiet + 1);
        {report, R, Now} -> timer:sleep(20), report(R, Now, 0)
    after 10000 -> exit(receiver_silent)
    end.

%% Numbers must go up: a number not above the last one is a reordering or a
%% duplicate (gaps are messages refused or dropped).
collector() ->
    collector({0, 0, 0, 0, sets:new([{version, 2}]), 0}).

collector(State = {Count, Bad, Last, Single, Tags, Extra}) ->
    receive
        {report, ReplyTo} ->
            ReplyTo ! {report, self(), State},
            collector(State);
        {seq, _From, I, _Payload} ->
            collector(number(I, {Count, Bad, Last, Single + 1, Tags, Extra}));
        {multi, _From, Tag, Numbers, _Payload} ->
            collector(number(maps:get(self(), Numbers),
                             {Count, Bad, Last, Single, sets:add_element(Tag, Tags), Extra}));
        {extra, _From, _I, _Payload} ->
            collector({Count, Bad, Last, Single, Tags, Extra + 1})
    end.

number(I, {Count, Bad, Last, Single, Tags, Extra}) when I > Last ->
    {Count + 1, Bad, I, Single, Tags, Extra};
number(_I, {Count, Bad, Last, Single, Tags, Extra}) ->
    {Count + 1, Bad + 1, Last, Single, Tags, Extra}.
